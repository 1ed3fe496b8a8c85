"""04's attackers (issue 23; opdkit.jobs.antidistill.points): a short antidistill run with sft, opd and
opd-plain end to end; the plain-scored student shared by the points of one temperature (and opd's at λ = 0);
the on-policy students' scoring teacher serving the ADS distribution of the point; the figure and the
paragraph; the config's checks."""

from __future__ import annotations

import pytest
import torch

from opdkit.ads.direction import FiniteDifference
from opdkit.ads.teacher import ADSTeacher
from opdkit.config import ConfigError, load_config
from opdkit.jobs import antidistill
from opdkit.jobs.antidistill import points, report, sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.sweep import Point
from opdkit.notebook import verdicts
from opdkit.run.folders import RunDir

SHORT = {
    "lams": [0.0, 0.08],
    "answer_lams": [],
    "temperatures": [1.0],
    "attackers": ["sft", "opd", "opd-plain"],
    "defences": ["topk:1", "sampled"],  # defended attackers (issue 50), at the λ 0, τ 1 point
    "subset_size": 48,
    "eval_size": 40,
    "sft_max_steps": 4,
    "sft_batch_size": 16,
    "max_steps": 3,  # the on-policy attackers' OPDTraining
    "per_device_train_batch_size": 8,
    "trace_max_new_tokens": 40,
    "rollout_max_new_tokens": 40,
}


@pytest.fixture(scope="module")
def short_run(grads_run, tmp_path_factory) -> RunDir:
    path = tmp_path_factory.mktemp("attack") / "run"
    return antidistill.run("tiny", {**SHORT, "grads_run": str(grads_run), "run_dir": str(path)})


def test_every_point_records_every_attacker(short_run):
    summary = short_run.read_summary()
    assert summary["status"] == "done"
    by_name = {p["name"]: p for p in summary["points"]}
    assert set(by_name) == {"temperature-lam0-tau1", "ads-lam0.08-tau1"}
    for p in by_name.values():
        for a in ("sft", "opd", "opd-plain"):
            for measure in ("student_accuracy", "student_holdout_loss"):
                assert 0 <= p[points.result_key(a, measure)] < float("inf")
        run = p["runs"][0]
        assert run["opd_steps"] == 3 and run["opd_plain_steps"] == 3
    zero, ads = by_name["temperature-lam0-tau1"], by_name["ads-lam0.08-tau1"]
    # the plain teacher at τ = 1 is one teacher: trained once, opd's at λ = 0, every point's control
    assert zero["opd_student_holdout_loss"] == zero["opd_plain_student_holdout_loss"]
    assert ads["opd_plain_student_holdout_loss"] == zero["opd_plain_student_holdout_loss"]
    assert [p.name for p in (short_run.path / points.PLAIN_DIR).iterdir()] == ["tau1-seed42"]
    # ... while the ADS-scored student at λ ≠ 0 learnt from another teacher
    assert ads["opd_student_holdout_loss"] != ads["opd_plain_student_holdout_loss"]
    steps = short_run.path / "points" / "ads-lam0.08-tau1" / "seed42" / points.OPD_DIR / "metrics.jsonl"
    assert len(steps.read_text().splitlines()) == 3


def test_figure_and_paragraph_come_from_the_run(short_run):
    summary = short_run.read_summary()
    assert report.attackers_in(summary) == ["sft", "opd", "opd-plain"]
    assert report.attackers(short_run) is not None and short_run.figure("attackers").is_file()
    text = report.attackers_explained(summary)
    ads = next(p for p in summary["points"] if p["lam"] != 0)
    gap = ads["opd_student_accuracy"] - ads["opd_plain_student_accuracy"]
    (found,) = summary["findings"]["attackers"]  # λ = 0 is no comparison: opd is the control there
    assert found["mean"] == pytest.approx(gap) and found["word"] == "within noise at 1 seed"
    assert text.startswith("**Finding.** Serving the ADS distribution slows the on-policy attacker")
    assert f"λ=0.08: {verdicts.points(gap)}, **within noise at 1 seed**" in text
    assert "shared by every λ of that temperature" in text
    rows = report.attack_rows(summary)
    assert [r["opd"] for r in rows] == [p["opd_student_accuracy"] for p in summary["points"]]


def test_defended_attackers_run_at_the_control_point(short_run):
    """Each defence: an on-policy student of the plain teacher behind it, at the control point only, kept in
    defended/; its costs beside it; a row of the table per defence and ADS's λ."""
    summary = short_run.read_summary()
    by_name = {p["name"]: p for p in summary["points"]}
    (run,) = by_name["temperature-lam0-tau1"]["runs"]
    assert list(run["defences"]) == ["topk:1", "sampled"]
    assert all(d["steps"] == 3 and 0 <= d["student_accuracy"] <= 1 for d in run["defences"].values())
    assert set(run["defence_costs"]) == {"topk:1", "sampled", "ads:0.08"}
    assert run["defence_costs"]["sampled"]["kl"] is None and run["defence_costs"]["topk:1"]["kl"] > 0
    assert "defences" not in by_name["ads-lam0.08-tau1"]["runs"][0]
    assert sorted(p.name for p in (short_run.path / "defended").iterdir()) == [
        "sampled-seed42",
        "topk1-seed42",
    ]
    steps = (short_run.path / "defended" / "topk1-seed42" / "metrics.jsonl").read_text().splitlines()
    assert len(steps) == 3 and '"teacher_defence": "topk:1"' in steps[0]
    rows = summary["findings"]["defences"]
    assert [r["defence"] for r in rows] == ["topk:1", "sampled", "ads:0.08"]
    assert rows[0]["mean"] == pytest.approx(
        run["defences"]["topk:1"]["student_accuracy"] - run["opd_plain_student_accuracy"]
    )
    assert report.defences(short_run) is not None and short_run.figure("defences").is_file()


def test_only_sft_draws_no_attacker_figure():
    summary = {"points": [{"name": "x", "lam": 0.0, "temperature": 1.0, "student_accuracy": 0.5}]}
    assert report.attackers_in(summary) == ["sft"]
    assert "only the SFT attacker" in report.attackers_explained(summary)


def test_scoring_teachers_serve_the_point_s_distribution(grads_run):
    """opd: (z + λΔ)/τ of the point; opd-plain: z/τ, whatever the point's λ."""
    prep = antidistill.prepare("tiny", {**SHORT, "grads_run": str(grads_run)})
    steering, _ = sweep.load_steering(
        prep.cfg, prep.proxy_tokenizer, prep.student_tokenizer, grads_run, torch.device("cpu")
    )
    point = Point("ads", 0.08, 1.3)
    ids = torch.tensor([[5, 9, 11, 7, 3, 8]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        z = steering.teacher(input_ids=ids, attention_mask=mask).logits
        d = FiniteDifference(steering.proxy, steering.grads["completion"], prep.cfg.eps).full(ids, mask)
    opd = points.scoring_teacher("opd", point, steering)
    plain = points.scoring_teacher("opd-plain", point, steering)
    assert isinstance(opd, ADSTeacher) and opd.lam == 0.08 and opd.temperature == 1.3
    torch.testing.assert_close(opd(input_ids=ids, attention_mask=mask).logits, (z + 0.08 * d) / 1.3)
    torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask).logits, z / 1.3)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"attackers": ["opd"]}, "sft is among them"),
        ({"attackers": ["sft", "dpo"]}, "each is one of"),
        ({"attackers": ["sft", "opd"], "ads_method": "jvp"}, "set ads_method fd"),
        ({"attackers": ["sft", "opd-plain"], "temperatures": [0.0, 1.0]}, "temperature 0"),
    ],
)
def test_config_refuses_attackers_it_cannot_run(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(AntidistillConfig, "tiny", over)


def test_tiny_default_keeps_only_the_sft_attacker():
    assert load_config(AntidistillConfig, "tiny").attackers == ["sft"]


def test_with_teacher_server_the_scoring_teacher_takes_the_served_states(grads_run):
    """`teacher_server` (a stub pooling server serving 04's tiny teacher): the attackers' ADS teacher, on
    the trainer's path (base_model states x stacked head), gives the in-process one's logits; the config
    refuses what 04 cannot use."""
    from helpers import StubPoolingServer

    from opdkit.models import load_tokenizer
    from opdkit.opd.teachers import served
    from opdkit.opd.teachers.served.head import load_head

    prep = antidistill.prepare("tiny", {**SHORT, "grads_run": str(grads_run)})
    steering, _ = sweep.load_steering(
        prep.cfg, prep.proxy_tokenizer, prep.student_tokenizer, grads_run, torch.device("cpu")
    )
    name = prep.cfg.teacher_model
    ids = torch.tensor([[5, 9, 11, 7, 3, 8]])
    mask = torch.ones_like(ids)
    with StubPoolingServer(steering.teacher, name, load_tokenizer(name)) as stub:
        client = served.PoolingClient(stub.url, dtype="float32", retries=1)
        st = served.ServedTeacher(client, load_head(name, torch.float32), served_dtype="float32")
        for attacker, point in (("opd", Point("ads", 0.08, 1.3)), ("opd-plain", Point("t", 0.0, 1.0))):
            got, want = (points.scoring_teacher(attacker, point, steering, base) for base in (st, None))
            with torch.no_grad():
                logits = [
                    t.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
                    @ t.get_output_embeddings().weight.T
                    for t in (got, want)
                ]
            torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    for over, match in (
        ({"teacher_server": "http://x"}, "on-policy attackers"),
        ({"teacher_server": "local", "attackers": ["sft", "opd"]}, "running pooling server"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(AntidistillConfig, "tiny", over)
