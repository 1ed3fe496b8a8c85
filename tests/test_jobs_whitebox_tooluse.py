"""05's report of a tool-use run (`opdkit.jobs.whitebox.tooluse`): its findings are the paired lifts over
seeds judged on their Student-t interval (computed here with scipy), its table carries both measures with
their intervals, and a run of one seed says it has none. The transcript view is tested on the trainer's own
samples in tests/test_rollout_multiturn.py."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from opdkit.jobs.whitebox import tooluse


def seed(before, after, call_before, call_after):
    return {
        "student_accuracy_before": before,
        "student_accuracy_after": after,
        "student_tool_call_share_before": call_before,
        "student_tool_call_share_after": call_after,
        "teacher_accuracy": 0.99,
        "teacher_tool_call_share": 1.0,
        "status": "done",
    }


SEEDS = {42: seed(0.0, 0.99, 0.0, 1.0), 43: seed(0.0, 0.47, 0.0, 0.98), 44: seed(0.01, 0.95, 0.0, 0.97)}


def repeated() -> dict:
    means = {
        k: sum(s[k] for s in SEEDS.values()) / len(SEEDS)
        for k in SEEDS[42]
        if isinstance(SEEDS[42][k], float)
    }
    return {**means, "repeats": 3, "finding": {"claim": "x"}, "seeds": {str(k): v for k, v in SEEDS.items()}}


def t_interval(values):
    n, mean = len(values), sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def test_findings_are_the_paired_lifts_judged_on_their_interval():
    calls, accuracy, goal = tooluse.findings(repeated())
    for found, (before, after) in (
        (calls, ("student_tool_call_share_before", "student_tool_call_share_after")),
        (accuracy, ("student_accuracy_before", "student_accuracy_after")),
    ):
        mean, low, high = t_interval([s[after] - s[before] for s in SEEDS.values()])
        assert found["mean"] == pytest.approx(mean) and found["n"] == 3
        assert found["ci"] == pytest.approx([low, high])
    assert calls["word"] == "holds"  # [0.93, 1.04]: above 0
    mean, low, high = t_interval(
        [s["student_accuracy_after"] - s["student_accuracy_before"] for s in SEEDS.values()]
    )
    assert low > 0 and accuracy["word"] == "holds"
    # the goal of +40 points: the interval reaches below 0.40, so it is within noise, not held
    assert low < tooluse.GOAL < high and goal["word"].startswith("within noise")


def test_one_seed_has_no_interval_and_says_how_to_get_one():
    one = {**SEEDS[42], "finding": {"claim": "x"}}
    calls, accuracy, _ = tooluse.findings(one)
    assert calls["n"] == accuracy["n"] == 1 and accuracy["mean"] == pytest.approx(0.99)
    text = tooluse.explain(one)
    assert "tiny-tools-seeds" in text and text.count("**Finding.**") == 3


def test_the_table_shows_both_measures_with_their_intervals():
    summary = repeated()
    mean, low, high = t_interval([s["student_accuracy_after"] for s in SEEDS.values()])
    summary["student_accuracy_after_ci"] = [low, high]
    html = tooluse.summary_table_html(summary)
    assert "answer accuracy" in html and "calls the tool correctly" in html
    assert f"{mean * 100:.1f} % [{low * 100:.1f}, {high * 100:.1f}]" in html
    assert "mean of 3 seeds" in html
    assert tooluse.explain({"status": "training"}).startswith("- the run has no finding")
