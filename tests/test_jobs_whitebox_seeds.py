"""02 repeated over seeds: the seeds' runs gathered into means with their 95 % Student-t intervals, checked
against a hand computation with the textbook quantile; the lift's verdict paired by seed; one real repeated
tiny run (slow)."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from opdkit.config import load_config
from opdkit.jobs import whitebox
from opdkit.jobs.whitebox import seeds
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.run.folders import RunDir

T_975 = {2: 12.706, 3: 4.303}  # Student-t 0.975 quantiles with n - 1 degrees of freedom (printed tables)


def hand_interval(values: list[float]) -> tuple[float, float, float]:
    n, mean = len(values), statistics.fmean(values)
    half = T_975[n] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def summary(before: float, after: float, **extra) -> dict:
    return {
        "student_accuracy_before": before,
        "student_accuracy_after": after,
        "teacher_accuracy": 0.99,
        "steps": 4,
        "status": "done",
        **extra,
    }


def test_the_lift_is_judged_seed_by_seed():
    # Each seed's student starts elsewhere; the lifts (0.30, 0.34, 0.26) agree although the levels do not.
    lifted = [summary(0.10, 0.40), summary(0.30, 0.64), summary(0.20, 0.46)]
    v = seeds.finding(lifted)
    mean, low, high = hand_interval([0.30, 0.34, 0.26])
    assert v["word"] == "holds" and v["n"] == 3
    assert v["mean"] == pytest.approx(mean) and v["ci"] == pytest.approx([low, high], abs=1e-3)
    fell = [summary(0.5, 0.2), summary(0.5, 0.21), summary(0.5, 0.19)]
    assert seeds.finding(fell)["word"] == "does not hold"
    assert seeds.finding([summary(0.2, 0.5)])["word"] == "within noise at 1 seed"
    noisy = seeds.finding([summary(0.2, 0.5), summary(0.2, 0.1), summary(0.2, 0.3)])
    assert noisy["word"] == "within noise at 3 seeds"


def test_gather_means_every_measure_over_the_seed_folders(tmp_path):
    cfg = load_config(WhiteboxConfig, "tiny", {"repeats": 3, "seed": 7, "run_dir": str(tmp_path / "run")})
    run = RunDir.attach(tmp_path / "run")
    afters = {7: 0.40, 8: 0.64, 9: 0.46}
    for seed, after in afters.items():
        path = seeds.seed_path(run, seed)
        path.mkdir(parents=True)
        (path / "summary.json").write_text(json.dumps(summary(0.2, after)))
    out = seeds.gather(run, cfg)
    mean, low, high = hand_interval(list(afters.values()))
    assert out["student_accuracy_after"] == pytest.approx(mean)
    assert out["student_accuracy_after_ci"] == pytest.approx([low, high], abs=1e-3)
    assert out["student_accuracy_before"] == pytest.approx(0.2) and out["repeats"] == 3
    assert out["status"] == "done" and set(out["seeds"]) == set(afters)
    assert [r.path.name for r in seeds.seed_runs(run)] == ["seed7", "seed8", "seed9"]
    (seeds.seed_path(run, 9) / "summary.json").unlink()  # a seed not finished: the run is not done
    assert seeds.gather(run, cfg)["status"].startswith("incomplete")


def test_a_seeds_run_is_the_parents_settings_at_its_seed_run_once(tmp_path):
    cfg = load_config(WhiteboxConfig, "tiny", {"repeats": 3, "max_steps": 5, "run_dir": str(tmp_path)})
    over = seeds.seed_overrides(cfg, 43)
    assert over["seed"] == 43 and over["repeats"] == 1 and over["max_steps"] == 5
    assert "run_dir" not in over and "resume" not in over


@pytest.mark.slow
def test_a_repeated_tiny_run_writes_one_run_per_seed_and_their_mean(tmp_path):
    over = dict(max_steps=2, eval_size=16, sample_every=0, checkpoint_every=0, subset_size=32, repeats=2)
    run = whitebox.run("tiny", {**over, "run_dir": str(tmp_path / "run")})
    out = run.read_summary()
    children = [RunDir.attach(tmp_path / "run" / "seeds" / f"seed{s}").read_summary() for s in (42, 43)]
    assert out["repeats"] == 2 and out["status"] == "done"
    afters = [c["student_accuracy_after"] for c in children]
    assert out["student_accuracy_after"] == pytest.approx(statistics.fmean(afters))
    if afters[0] != afters[1]:
        assert out["student_accuracy_after_ci"] == pytest.approx(list(hand_interval(afters)[1:]), abs=1e-3)
    assert out["finding"]["n"] == 2
