"""antidistill's report (opdkit.jobs.antidistill.report, with its figures): the gap between ADS and
temperature sampling at equal teacher accuracy, the paragraph naming failed points, and the token lens
showing exactly the tokens ADS moved."""

from __future__ import annotations

import pytest

from opdkit.jobs.antidistill import report


def test_gap_compares_ads_with_temperature_at_equal_teacher_accuracy():
    pts = [
        {
            "name": "t1",
            "method": "temperature",
            "lam": 0.0,
            "temperature": 1.0,
            "teacher_accuracy": 0.9,
            "student_accuracy": 0.8,
        },
        {
            "name": "t2",
            "method": "temperature",
            "lam": 0.0,
            "temperature": 1.5,
            "teacher_accuracy": 0.5,
            "student_accuracy": 0.4,
        },
        {
            "name": "a1",
            "method": "ads",
            "lam": 0.1,
            "temperature": 1.0,
            "teacher_accuracy": 0.7,
            "student_accuracy": 0.5,
        },
        {
            "name": "a2",
            "method": "ads",
            "lam": 0.2,
            "temperature": 1.0,
            "teacher_accuracy": 0.3,
            "student_accuracy": 0.1,
        },
    ]
    summary = {"points": pts, "student_accuracy_before": 0.2}
    got = {g["name"]: g for g in report.gaps(summary)}
    assert got["a1"]["temperature_student_accuracy"] == pytest.approx(0.6)
    assert got["a1"]["gap"] == pytest.approx(-0.1)
    assert got["a2"]["gap"] is None  # below the temperature sweep's range: no extrapolation
    text = report.explain(summary)
    assert "10.0 points lower" in text and "no comparison" in text and "mean gap -10.0 points" in text
    assert [c["temperature"] for c in report.tradeoff_curves(summary)["temperature"]] == [1.0, 1.5]
    assert [c["lam"] for c in report.tradeoff_curves(summary)["ADS (τ=1)"]] == [0.0, 0.1, 0.2]


def test_explain_names_the_failed_points():
    summary = {
        "points": [],
        "failed_points": [{"name": "ads-lam0.1-tau1", "error": "Traceback ...\nRuntimeError: boom\n"}],
    }
    assert "ads-lam0.1-tau1 failed** (RuntimeError: boom)" in report.explain(summary)


def test_token_lens_marks_exactly_the_tokens_ads_moved(small_run):
    lens = report.TokenLens(small_run, num_prompts=3)
    same = lens.compare(0, 0.0, seed=1)
    assert not any(t["changed"] for t in same["tokens"])
    assert same["completion"] == same["plain_completion"]
    moved = lens.compare(0, 0.5, seed=1)
    assert lens.compare(0, 0.1, seed=1, method="ads-answer")["method"] == "ads-answer"
    first = next(i for i, t in enumerate(moved["tokens"]) if t["changed"])
    # up to the first change the two traces are the same tokens, drawn with the same noise
    assert moved["completion"].startswith("".join(t["text"] for t in moved["tokens"][:first]))
    assert moved["plain_completion"].startswith("".join(t["text"] for t in moved["tokens"][:first]))
    html = report.token_changes_html(moved)
    assert "plain sampling drew" in html
    fig = report.token_changes_figure([same, moved])
    assert fig.axes
