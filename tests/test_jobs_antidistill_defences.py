"""What stops an on-policy attacker (opdkit.jobs.antidistill.defences, findings.defences, the report's table,
paragraph and figure; issue 50): the verdicts and costs on synthetic per-seed numbers, the honest user's cost
against `defended.honest_cost` on a stub teacher, and the config's checks of `defences`."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutput

from opdkit.config import ConfigError, load_config
from opdkit.jobs.antidistill import defences, report
from opdkit.jobs.antidistill import findings as fd
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.notebook import verdicts
from opdkit.opd.teachers.defended import Defence, distribution_cost, honest_cost

SEEDS = (42, 43, 44)
PLAIN = (0.50, 0.60, 0.40)
TOPK1 = (0.30, 0.38, 0.22)  # 20, 22 and 18 points below the control: slowed by its interval
ROUND = (0.52, 0.57, 0.44)  # +2, -3, +4: within noise
ADS = (0.49, 0.62, 0.38)


def synthetic_summary() -> dict:
    runs = []
    for i, seed in enumerate(SEEDS):
        runs.append(
            {
                "seed": seed,
                "teacher_accuracy": 0.9,
                "opd_plain_student_accuracy": PLAIN[i],
                "defences": {
                    "topk:1": {"student_accuracy": TOPK1[i]},
                    "round:1": {"student_accuracy": ROUND[i]},
                },
                "defence_costs": {
                    "topk:1": {"kl": 0.1 + 0.01 * i, "top1": 1.0},
                    "round:1": {"kl": 1e-4, "top1": 0.99},
                    "ads:0.05": {"kl": 0.03, "top1": 0.94},
                },
            }
        )
    control = {"name": "temperature-lam0-tau1", "method": "temperature", "lam": 0.0, "temperature": 1.0}
    ads_runs = [{"seed": s, "teacher_accuracy": 0.88, "opd_student_accuracy": a} for s, a in zip(SEEDS, ADS)]
    ads = {"name": "ads-lam0.05-tau1", "method": "ads", "lam": 0.05, "temperature": 1.0}
    return {"points": [{**control, "runs": runs}, {**ads, "runs": ads_runs, "opd_student_accuracy": 0.5}]}


def test_each_defence_is_judged_against_its_control_paired_by_seed():
    rows = fd.defences(synthetic_summary()["points"])
    assert [r["defence"] for r in rows] == ["topk:1", "round:1", "ads:0.05"]
    by = {r["defence"]: r for r in rows}
    for spec, student in (("topk:1", TOPK1), ("round:1", ROUND), ("ads:0.05", ADS)):
        want = verdicts.verdict("x", [a - b for a, b in zip(student, PLAIN)], above=False)
        assert by[spec]["mean"] == pytest.approx(want["mean"]) and by[spec]["ci"] == pytest.approx(want["ci"])
        assert by[spec]["n"] == 3
    assert by["topk:1"]["word"] == verdicts.HOLDS and by["round:1"]["word"] == "within noise at 3 seeds"
    assert by["topk:1"]["kl"]["mean"] == pytest.approx(0.11) and by["topk:1"]["top1"]["mean"] == 1.0
    assert by["ads:0.05"]["kl"]["mean"] == pytest.approx(0.03)
    assert by["ads:0.05"]["teacher_accuracy"]["mean"] == pytest.approx(0.88), "ADS's own accuracy"
    assert by["round:1"]["teacher_accuracy"]["mean"] == pytest.approx(0.9), "unchanged by a score defence"
    assert not by["topk:1"]["wide"] and by["ads:0.05"]["wide"] == (
        by["ads:0.05"]["ci"][1] - by["ads:0.05"]["mean"] > 0.1
    )


def test_a_student_ending_below_its_start_by_its_interval_is_damaged():
    points = synthetic_summary()["points"]
    assert not any(r["damaged"] for r in fd.defences(points, before=0.45))
    damaged = {r["defence"]: r["damaged"] for r in fd.defences(points, before=0.6)}
    assert damaged == {"topk:1": True, "round:1": False, "ads:0.05": False}
    text = report.defences_explained({"points": points, "student_accuracy_before": 0.6})
    assert "**damaged**: its student ends below where it started (60.0 %)" in text
    assert "topk:1 more than slows it" in text


def test_table_paragraph_and_figure_come_from_the_rows(tmp_path):
    summary = synthetic_summary()
    rows = {r["defence"]: r for r in fd.defences(summary["points"])}
    html = report.defences_table_html(summary)
    assert html.count("<tr>") == 1 + 1 + 3  # the header, the control, three defences
    assert verdicts.stat_text(rows["topk:1"], signed=True) in html and verdicts.HOLDS in html
    text = report.defences_explained(summary)
    assert f"({verdicts.stat_text(rows['topk:1'], signed=True)}, 3 seeds)" in text
    assert "**What stops an on-policy attacker here.** At 3 seeds, 1 of 3 defences slow" in text
    assert "KL 0.11 nats" in text
    fig = report.defences_figure(summary, path=tmp_path / "d.png")
    assert (tmp_path / "d.png").is_file() and len(fig.axes) == 2


def test_a_run_without_defences_says_so():
    summary = {"points": [{"name": "x", "method": "temperature", "lam": 0.0, "temperature": 1.0, "runs": []}]}
    assert fd.defences(summary["points"]) == []
    assert "No defences" in report.defences_table_html(summary)
    assert "no defences ran" in report.defences_explained(summary)


class StubTeacher(torch.nn.Module):
    """Fixed logits per position (batch, T, V): what `serving_costs` reads of a teacher."""

    def __init__(self, logits_TV: torch.Tensor):
        super().__init__()
        self.logits_TV = logits_TV

    def forward(self, input_ids, attention_mask=None):
        b, t = input_ids.shape
        return CausalLMOutput(logits=self.logits_TV[:t].expand(b, t, -1))


def test_serving_costs_are_the_mean_honest_cost_over_completion_positions():
    g = torch.Generator().manual_seed(0)
    logits_TV = torch.randn(6, 8, generator=g) * 2
    ads_TV = logits_TV + torch.randn(6, 8, generator=g)
    rows = [
        {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [-100, -100, 3, 4, 5, 6]}
    ]  # positions 1-4 predict 3-6
    got = defences.serving_costs(
        ["topk:2", "sampled", "noise:0.5"],
        StubTeacher(logits_TV),
        {"ads:0.1": StubTeacher(ads_TV)},
        rows,
        pad_token_id=0,
        vocab=8,
        device=torch.device("cpu"),
        seed=7,
    )
    at_NV, actual_N = logits_TV[1:5], torch.tensor([3, 4, 5, 6])
    gen = torch.Generator().manual_seed(7)
    want = {s: honest_cost(Defence.of(s), at_NV, actual_N, gen) for s in ("topk:2", "noise:0.5")}
    want["ads:0.1"] = distribution_cost(at_NV, torch.log_softmax(ads_TV[1:5], -1))
    for label, cost in want.items():
        assert got[label]["kl"] == pytest.approx(float(cost["kl_N"].mean()), rel=1e-5)
        assert got[label]["top1"] == pytest.approx(float(cost["top1_N"].mean()))
        assert got[label]["positions"] == 4
    assert got["sampled"]["kl"] is None and got["sampled"]["top1"] is None


@pytest.mark.parametrize(
    "over,match",
    [
        ({"defences": ["topk:0"]}, "K must be a positive integer"),
        ({"defences": ["none"]}, "that is the control"),
        ({"defences": ["sampled"], "beta": 0.5}, "estimates reverse KL only"),
        ({"defences": ["round:1"], "attackers": ["sft", "opd"]}, "add opd-plain"),
        ({"defences": ["round:1"], "temperatures": [1.4], "ads_temperatures": [1.4]}, "1.0 to temp"),
    ],
)
def test_config_refuses_defences_it_cannot_measure(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(AntidistillConfig, "tiny-attack", over)


def test_the_defences_preset_runs_every_defence_against_its_control():
    cfg = load_config(AntidistillConfig, "tiny-defences")
    assert cfg.repeats == 3 and "opd-plain" in cfg.attackers and cfg.lams == [0.0, 0.05, 0.11]
    assert cfg.defences == ["topk:20", "topk:5", "topk:1", "sampled", "round:1", "round:2", "noise:0.5"]
