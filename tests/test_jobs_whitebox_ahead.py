"""02's arms sampling ahead (`ahead_arms`, `opdkit.jobs.whitebox.ahead`): the arms parse and bad ones are one
line before anything is written; the comparison of synthetic run folders (written here as the runs write
them) has the means, Student-t intervals and paired differences scipy computes, and the verdicts they imply;
the table, the figure and the explanation show them; forward against reverse KL, each side's cost paired by
seed, against scipy; one real tiny run with an arm (slow)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import yaml
from scipy import stats

from opdkit.config import ConfigError, load_config
from opdkit.jobs import whitebox
from opdkit.jobs.whitebox import ahead, seeds
from opdkit.jobs.whitebox.config import WhiteboxConfig, parse_ahead_arms
from opdkit.notebook.figures import smallest_text_px
from opdkit.run.folders import RunDir


def test_arms_parse_into_steps_ahead_and_correction():
    arms = parse_ahead_arms("1,1t,4,4t")
    assert [(a.name, a.ahead, a.correction) for a in arms] == [
        ("1", 1, "none"),
        ("1t", 1, "truncated"),
        ("4", 4, "none"),
        ("4t", 4, "truncated"),
    ]
    cfg = load_config(WhiteboxConfig, "tiny", {"ahead_arms": " 2, 02t"})  # spaces dropped, names canonical
    assert cfg.ahead_arms == "2,02t" and [a.name for a in cfg.arms()] == ["2", "2t"]
    assert load_config(WhiteboxConfig, "tiny", {"ahead_arms": 3}).arms()[0].ahead == 3  # papermill's int
    assert load_config(WhiteboxConfig, "tiny").arms() == []
    assert arms[1].overrides() == {"rollout_ahead": 1, "async_correction": "truncated", "ahead_arms": ""}


@pytest.mark.parametrize(
    "over, message",
    [
        ({"ahead_arms": "0"}, "ahead_arms: '0' is no arm"),
        ({"ahead_arms": "1,2x"}, "ahead_arms: '2x' is no arm"),
        ({"ahead_arms": "t"}, "ahead_arms: 't' is no arm"),
        ({"ahead_arms": "1,01"}, "ahead_arms: arm 1 is given twice"),
        ({"ahead_arms": "1", "rollout_ahead": 1}, "set rollout_ahead 0"),
        ({"ahead_arms": "1", "vllm_sleep": True}, "ahead_arms: arm 1: vllm_sleep frees"),
    ],
)
def test_a_bad_arm_is_one_line(over, message):
    with pytest.raises(ConfigError) as e:
        load_config(WhiteboxConfig, "tiny", over)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_arm_on_the_command_line_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "opdkit.whitebox", "--set", "ahead_arms=1,1q", f"run_dir={out}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and not out.exists()
    assert proc.stderr.strip().splitlines() == [
        "error: ahead_arms: '1q' is no arm; each is s (steps sampled ahead, >= 1, uncorrected) or st (the "
        "same, truncated correction), comma-separated, e.g. 1,1t,4,4t."
    ]


def test_arms_need_one_process():
    with pytest.raises(ConfigError, match="set num_processes 1"):
        whitebox.prepare("tiny", {"ahead_arms": "1", "num_processes": 2, "subset_size": 64, "eval_size": 8})


def test_an_arm_is_the_parents_run_sampling_ahead_and_a_seed_runs_no_arms(tmp_path):
    cfg = load_config(WhiteboxConfig, "tiny", {"ahead_arms": "1,4t", "repeats": 3, "run_dir": str(tmp_path)})
    over = ahead.arm_overrides(cfg, cfg.arms()[1])
    assert over["rollout_ahead"] == 4 and over["async_correction"] == "truncated" and over["ahead_arms"] == ""
    assert (
        over["repeats"] == 3 and over["seed"] == cfg.seed and "run_dir" not in over and "resume" not in over
    )
    assert seeds.seed_overrides(cfg, 43)["ahead_arms"] == ""
    assert ahead.arm_path(RunDir.attach(tmp_path), cfg.arms()[1]) == tmp_path / "arms" / "4t"


# Synthetic runs: per arm and seed the final accuracy, the step time (completion_tokens / tokens_per_s) and
# the importance ratios, written as metrics.jsonl and summary.json are.
SEEDS = (42, 43, 44)
FINAL = {
    "sync": (0.60, 0.70, 0.50),
    "1": (0.50, 0.61, 0.39),  # 9 to 11 points below synchronous at every seed
    "1t": (0.59, 0.71, 0.50),  # back within a point of it
    "4": (0.62, 0.73, 0.52),  # above it at every seed
}
STEP_S = {
    "sync": (0.50, 0.52, 0.49),
    "1": (0.40, 0.38, 0.41),
    "1t": (0.41, 0.39, 0.40),
    "4": (0.30, 0.31, 0.33),
}
STEPS = 4


def records(arm: str, k: int) -> list[dict]:
    out = []
    for step in range(1, STEPS + 1):
        tokens = 1000.0 + 10 * step
        r = {"step": step, "loss": 1.0 / step, "grad_norm": 2.0, "completion_tokens": tokens}
        r["tokens_per_s"] = tokens / (STEP_S[arm][k] * (1 + 0.01 * step))
        if arm != "sync":
            ahead_by = int(arm.rstrip("t"))
            r |= {
                "async/staleness": min(step - 1, ahead_by),
                "async/ratio_mean": 1.0 - 0.01 * step - 0.001 * k,
                "async/ratio_max": 3.0 + step * (k + 1),
                "async/capped_share": 0.01 * step,
            }
        out.append(r)
        if step % 2 == 0:
            out.append({"step": step, "eval_accuracy": FINAL[arm][k] * step / STEPS})
    return out


def write_run(path, arm: str, k: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    config = {"job": "whitebox", "seed": SEEDS[k], "async_ratio_cap": 2.0}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(arm, k)))
    summary = {"student_accuracy_before": 0.05, "student_accuracy_after": FINAL[arm][k], "status": "done"}
    (path / "summary.json").write_text(json.dumps(summary))


def write_arms(root, seeds_=SEEDS) -> RunDir:
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({"job": "whitebox", "seed": 42, "async_ratio_cap": 2.0}))
    for arm in FINAL:
        base = root if arm == "sync" else root / "arms" / arm
        for k, seed in enumerate(seeds_):
            write_run(base / "seeds" / f"seed{seed}" if len(seeds_) > 1 else base, arm, k)
        if arm != "sync" and len(seeds_) > 1:  # a repeated arm's own summary
            (base / "summary.json").write_text(json.dumps({"status": "done"}))
    return RunDir.attach(root)


def t_interval(values: list[float]) -> tuple[float, list[float]]:
    mean = statistics.fmean(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=mean, scale=stats.sem(values))
    return mean, [low, high]


def train_time(arm: str, k: int, first: int = 1) -> float:
    steps = [r for r in records(arm, k) if "loss" in r and r["step"] >= first]
    return sum(r["completion_tokens"] / r["tokens_per_s"] for r in steps)


def test_the_comparison_has_scipys_intervals_and_the_paired_verdicts(tmp_path):
    c = ahead.comparison(write_arms(tmp_path / "run"))
    assert list(c["arms"]) == ["sync", "1", "1t", "4"] and c["repeats"] == 3
    for arm, e in c["arms"].items():
        mean, ci = t_interval(list(FINAL[arm]))
        assert e["final_accuracy"] == pytest.approx(mean) and e["final_accuracy_ci"] == pytest.approx(ci)
        times = [train_time(arm, k) for k in range(3)]
        mean, ci = t_interval(times)
        assert e["train_time_s"] == pytest.approx(mean) and e["train_time_s_ci"] == pytest.approx(ci)
        assert e["steps_per_s"] == pytest.approx(statistics.fmean(STEPS / t for t in times))
        steady = [train_time(arm, k, first=2) for k in range(3)]
        assert e["steady_steps_per_s"] == pytest.approx(statistics.fmean((STEPS - 1) / t for t in steady))
    e = c["arms"]["1"]
    mean, ci = t_interval([a - b for a, b in zip(FINAL["1"], FINAL["sync"])])
    assert e["against_sync"]["mean"] == pytest.approx(mean) and e["against_sync"]["ci"] == pytest.approx(ci)
    assert e["against_sync"]["word"] == "holds"  # staleness lowered the accuracy at every seed
    assert c["arms"]["1t"]["against_sync"]["word"] == "within noise at 3 seeds"
    assert c["arms"]["4"]["against_sync"]["word"] == "does not hold"  # more accurate than synchronous
    speed = [train_time("sync", k) / train_time("1", k) for k in range(3)]
    assert e["speedup"]["mean"] == pytest.approx(t_interval(speed)[0])
    assert e["speedup"]["ci"] == pytest.approx(t_interval(speed)[1])
    steady = [train_time("sync", k, 2) / train_time("1", k, 2) for k in range(3)]
    assert e["steady_speedup"]["mean"] == pytest.approx(t_interval(steady)[0])
    assert e["staleness"] == pytest.approx(statistics.fmean([0, 1, 1, 1]))
    assert e["ratio_max"] == pytest.approx(statistics.fmean([3 + STEPS * (k + 1) for k in range(3)]))
    assert e["ratio_mean"] == pytest.approx(
        statistics.fmean(1 - 0.01 * s - 0.001 * k for s in (1, 2, 3, 4) for k in range(3))
    )
    assert e["capped_share"] == pytest.approx(0.025)
    assert c["arms"]["sync"]["ratio_mean"] is None and "against_sync" not in c["arms"]["sync"]
    fix = next(f for f in c["findings"] if f["kind"] == "correction")
    assert (fix["arm"], fix["against"], fix["word"]) == ("1t", "1", "holds")
    assert fix["mean"] == pytest.approx(t_interval([a - b for a, b in zip(FINAL["1t"], FINAL["1"])])[0])
    assert [f["arm"] for f in c["findings"]] == ["1", "1t", "4", "1t"]


def test_the_table_figure_and_explanation_show_the_comparison(tmp_path):
    run = write_arms(tmp_path / "run")
    c = ahead.comparison(run)
    html = ahead.table_html(c)
    assert html.count("<tr>") == 5 and "s=1 corrected" in html and "mean of 3 seeds" in html
    text = ahead.explain(c)
    assert "At s=1 staleness **lowers** the final accuracy" in text
    assert "the truncated correction **wins it back**" in text and "to within noise of synchronous" in text
    assert "At s=4 the stale rollouts end **more** accurate" in text
    fig = ahead.figure(run)
    assert (run.path / "figures" / "sampling_ahead.png").is_file() and smallest_text_px(fig) >= 10.0
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["synchronous", "s=1", "s=1 corrected", "s=4"]


def test_one_seed_has_no_interval_and_a_run_without_arms_says_how_to_get_them(tmp_path):
    c = ahead.comparison(write_arms(tmp_path / "one", seeds_=(42,)))
    assert c["repeats"] == 1 and c["arms"]["1"]["against_sync"]["word"] == "within noise at 1 seed"
    assert c["arms"]["1"]["against_sync"]["mean"] == pytest.approx(0.50 - 0.60)
    assert "one seed (no interval)" in ahead.table_html(c) and "a verdict needs an interval" in ahead.explain(
        c
    )
    bare = tmp_path / "bare"
    write_run(bare, "sync", 0)
    c = ahead.comparison(RunDir.attach(bare))
    assert list(c["arms"]) == ["sync"] and ahead.explain(c) == ahead.HOW


# Forward against reverse KL: the same arms as FINAL (forward KL, beta 0) and these under reverse KL (beta 1),
# by seed: reverse loses 20 points at s=1 (forward 10), the two corrected arms alike, and gains 10 at s=4
# (forward 2-3).
REVERSE = {
    "sync": (0.62, 0.69, 0.55),
    "1": (0.42, 0.48, 0.36),
    "1t": (0.60, 0.71, 0.54),
    "4": (0.72, 0.80, 0.64),
}


def write_divergence(root, beta: float, final: dict) -> RunDir:
    run = write_arms(root)
    config = yaml.safe_load((root / "config.yaml").read_text()) | {"beta": beta}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    for arm, values in final.items():
        base = root if arm == "sync" else root / "arms" / arm
        for seed, value in zip(SEEDS, values):
            summary = base / "seeds" / f"seed{seed}" / "summary.json"
            summary.write_text(
                json.dumps(json.loads(summary.read_text()) | {"student_accuracy_after": value})
            )
    return run


def test_forward_against_reverse_kl_pairs_each_sides_cost_by_seed(tmp_path):
    forward = write_divergence(tmp_path / "fkl", 0.0, FINAL)
    reverse = write_divergence(tmp_path / "rkl", 1.0, REVERSE)
    d = ahead.divergences(forward, reverse)
    assert d["divergences"] == {"forward": "forward KL", "reverse": "reverse KL"} and d["repeats"] == 3
    assert list(d["arms"]) == ["sync", "1", "1t", "4"]
    for name, e in d["arms"].items():
        for side, final in (("forward", FINAL), ("reverse", REVERSE)):
            mean, ci = t_interval(list(final[name]))
            assert e[side]["final_accuracy"] == pytest.approx(mean)
            assert e[side]["final_accuracy_ci"] == pytest.approx(ci)
        if name == "sync":
            diffs = [f - r for f, r in zip(FINAL["sync"], REVERSE["sync"])]
        else:
            cost_f = [a - b for a, b in zip(FINAL[name], FINAL["sync"])]
            cost_r = [a - b for a, b in zip(REVERSE[name], REVERSE["sync"])]
            diffs = [f - r for f, r in zip(cost_f, cost_r)]
            assert list(e["cost_by_seed"]["forward"].values()) == pytest.approx(cost_f)
            assert e["reverse"]["against_sync"]["mean"] == pytest.approx(statistics.fmean(cost_r))
        mean, ci = t_interval(diffs)
        assert e["difference"]["mean"] == pytest.approx(mean) and e["difference"]["ci"] == pytest.approx(ci)
    words = {f["arm"]: f["word"] for f in d["findings"]}
    assert words == {"1": "holds", "1t": "within noise at 3 seeds", "4": "does not hold"}
    assert d["findings"][0]["claim"] == "at s=1 staleness costs forward KL less than reverse KL"
    html = ahead.divergences_table_html(d)
    assert html.count("<tr>") == 5 and "forward KL's cost minus reverse KL's" in html
    text = ahead.divergences_explain(d)
    assert text.startswith("**Does staleness cost forward KL less than reverse KL here?** **yes** at s=1; ")
    assert "**no**, it costs forward KL more at s=4; elsewhere within noise." in text
    assert "**Does staleness hurt forward KL here" in ahead.explain(ahead.comparison(forward))
    with pytest.raises(ConfigError, match="both runs are reverse KL: give one run per divergence"):
        ahead.divergences(reverse, reverse)


@pytest.mark.slow
def test_a_tiny_run_with_an_arm_writes_it_and_the_section_shows_it(tmp_path):
    over = dict(max_steps=3, eval_every=2, eval_every_size=8, eval_size=8, sample_every=0, checkpoint_every=0)
    over |= dict(subset_size=512, repeats=2, ahead_arms="1t", run_dir=str(tmp_path / "run"))
    run = whitebox.run("tiny", over)
    for seed in (42, 43):
        child = RunDir.attach(tmp_path / "run" / "arms" / "1t" / "seeds" / f"seed{seed}")
        assert child.read_summary()["status"] == "done" and child.read_config()["rollout_ahead"] == 1
        assert not (child.path / "arms").exists()
    c = ahead.comparison(run)
    assert list(c["arms"]) == ["sync", "1t"] and c["arms"]["1t"]["n"] == 2
    assert 0 < c["arms"]["1t"]["staleness"] < 1 and c["arms"]["1t"]["ratio_max"] >= 1.0
    assert run.read_summary()["ahead"]["arms"]["1t"]["final_accuracy"] == pytest.approx(
        c["arms"]["1t"]["final_accuracy"]
    )
    assert "s=1 corrected" in ahead.table_html(c) and "s=1: only the corrected arm" in ahead.explain(c)
    ahead.figure(run)
