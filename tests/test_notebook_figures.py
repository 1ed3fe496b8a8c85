"""The kit's figures, drawn from synthetic runs: readable where JupyterLab shows them (no text under 10 px,
nothing wider than its cell), in the palette, with units, intervals over seeds, and point labels that do not
overlap."""

from __future__ import annotations

import random

import matplotlib
import pytest

from opdkit.jobs.antidistill import figures as ad_figures
from opdkit.jobs.antidistill import findings
from opdkit.jobs.cliplesson import figures as clip_figures
from opdkit.notebook import figures
from opdkit.notebook.figures import MAX_WIDTH_IN, PALETTE, smallest_text_px


def records(seed: int, steps: int = 30, eval_every: int = 10) -> list[dict]:
    rng = random.Random(seed)
    out = [
        {
            "step": s,
            "loss": 1 / s + rng.random() * 0.1,
            "grad_norm": 2 + rng.random(),
            "completion_length": 20.0,
        }
        for s in range(1, steps + 1)
    ]
    for r in out:
        r["entropy"] = 0.5 + rng.random() * 0.1
    out += [
        {"step": s, "eval_accuracy": 0.2 + s / 50 + rng.random() * 0.05}
        for s in range(eval_every, steps + 1, eval_every)
    ]
    return out


def assert_readable(fig) -> None:
    assert fig.get_figwidth() <= MAX_WIDTH_IN + 1e-9
    assert smallest_text_px(fig) >= 10.0


def test_training_curves_one_run_and_seeds_with_bands():
    reference = {"teacher_accuracy": 0.9967, "student_accuracy_before": 0.206}
    one = figures.draw_training_curves([records(1)], 1.0, "whitebox · tiny", reference)
    assert_readable(one)
    acc = one.axes[4]
    assert (
        acc.get_title() == "held-out accuracy while training" and acc.get_ylim()[1] > 1.0
    )  # teacher in view
    labels = [t.get_text() for t in acc.get_legend().get_texts()]
    assert labels == ["teacher (99.7 %)", "student before (20.6 %)"]
    assert all(ax.get_ylabel() for ax in one.axes[:5])  # units on every panel
    seeds = figures.draw_training_curves([records(s) for s in (1, 2, 3)], 1.0, "three seeds", reference)
    assert_readable(seeds)
    assert any(isinstance(c, matplotlib.collections.PolyCollection) for c in seeds.axes[0].collections)


def test_band_series_is_the_mean_and_interval_of_the_steps_every_run_logged():
    runs = [[{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}], [{"step": 1, "loss": 3.0}]]
    steps, mean, low, high = figures.band_series(runs, "loss")
    assert steps == [1] and mean == [2.0] and low[0] < 2.0 < high[0]


def test_accuracy_bars_with_intervals_in_percent():
    summary = {
        "student_accuracy_before": 0.2,
        "student_accuracy_after": 0.8,
        "student_accuracy_after_ci": [0.7, 0.9],
        "teacher_accuracy": 0.99,
        "repeats": 3,
        "accuracy_precision": "fp32",
    }
    fig = figures.accuracy_bars(summary)
    assert_readable(fig)
    assert "80.0 %" in [t.get_text() for t in fig.axes[0].texts]
    assert fig.axes[0].get_yticklabels()[-1].get_text().endswith("%")


def lesson_arms() -> dict:
    arms = {}
    for name, clip in (("clip", True), ("noclip", False), ("sgd-clip", True), ("sgd-noclip", False)):
        seeds = {s: {"final_accuracy": 0.5 + 0.1 * s} for s in (1, 2, 3)}
        arms[name] = {
            "final_accuracy": 0.7,
            "final_accuracy_ci": [0.45, 0.95],
            "clipping": clip,
            "learning_rate": 1e-3,
            "optimizer": "adamw",
            "accuracy_before": 0.2,
            "seeds": seeds,
        }
    return arms


def test_lesson_figures_name_every_arm_in_its_own_colour():
    arms = lesson_arms()
    recs = {name: [records(s) for s in (1, 2, 3)] for name in arms}
    fig = clip_figures.lesson_curves(
        recs, {n: 1.0 for n in arms}, {n: e["clipping"] for n, e in arms.items()}
    )
    assert_readable(fig)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(arms) <= set(lines) and lines["noclip"].get_linestyle() == "--"
    colours = {lines[n].get_color() for n in arms}
    assert len(colours) == len(arms) and colours <= set(PALETTE.values())
    assert_readable(clip_figures.lesson_accuracy(arms))


def line_has_markers(ax, x: float, y: float) -> bool:
    """Is (x, y) on screen a marked point of one of `ax`'s lines (not a point of a marker-less line)?"""
    return any(
        line.get_marker() not in (None, "None", "")
        and any(
            abs(px - x) < 0.5 and abs(py - y) < 0.5 for px, py in ax.transData.transform(line.get_xydata())
        )
        for line in ax.lines
    )


def tradeoff_summary(crowded: bool = False) -> dict:
    """A sweep's summary; `crowded`: the points near the plain teacher as close as make demo's 04 put them."""
    rng = random.Random(0)

    def point(method, lam, tau, teacher, student):
        runs = [
            {
                "seed": s,
                "teacher_accuracy": teacher + rng.uniform(-0.01, 0.01),
                "student_accuracy": student + rng.uniform(-0.02, 0.02),
                "student_holdout_loss": 0.2 + lam,
                "opd_student_accuracy": student - 0.1,
                "opd_plain_student_accuracy": 0.55,
                "sft_student_accuracy": student,
            }
            for s in (42, 43, 44)
        ]
        return {
            "name": f"{method}-{lam}-{tau}",
            "method": method,
            "lam": lam,
            "temperature": tau,
            "runs": runs,
        }

    pts = [
        point("temperature", 0.0, t, 0.93 - 0.33 * (t - 1) / 0.6, 0.8 - 0.25 * (t - 1) / 0.6)
        for t in (1.0, 1.2, 1.4, 1.6)
    ]
    pts += [point("ads", lam, 1.0, 0.93 - 3.5 * lam, 0.8 - 2.6 * lam) for lam in (0.05, 0.08, 0.11)]
    pts += [point("ads-answer", lam, 1.0, 0.93 - 8 * lam, 0.8 - 14 * lam) for lam in (0.015, 0.03, 0.045)]
    if crowded:  # make demo's 04: (teacher, student) of τ=1.2, λ=0.05 and λ=0.015 within 7 points of τ=1's
        near = {("temperature", 1.2): (0.87, 0.80), ("ads", 0.05): (0.87, 0.81)}
        near[("ads-answer", 0.015)] = (0.91, 0.80)
        for p in pts:
            spot = near.get((p["method"], p["temperature"] if p["method"] == "temperature" else p["lam"]))
            for r in p["runs"] if spot else []:
                r["teacher_accuracy"], r["student_accuracy"] = spot[0] + rng.uniform(-0.005, 0.005), spot[1]
    pts = [findings.with_intervals(p) for p in pts]
    summary = {
        "points": pts,
        "student_accuracy_before": 0.22,
        "student_holdout_loss_before": 0.36,
        "repeats": 3,
    }
    return {**summary, "findings": findings.findings(summary)}


@pytest.mark.parametrize("crowded", [False, True])
def test_tradeoff_figure_is_readable_with_intervals_crossings_and_labels_apart(crowded, tmp_path):
    summary = tradeoff_summary(crowded)
    fig = ad_figures.tradeoff_figure(summary, path=tmp_path / "tradeoff.png")  # as saved: laid out
    assert_readable(fig)
    ax = fig.axes[0]
    assert "(%)" in ax.get_xlabel() and "(%)" in ax.get_ylabel()
    notes = [t for t in ax.texts if t.get_text().startswith(("λ=", "τ="))]
    assert len(notes) == 4 + 3 + 3  # every temperature, every ADS λ
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in notes]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    markers = [ax.transData.transform(xy) for line in ax.lines for xy in line.get_xydata()]
    assert not any(b.contains(x, y) for b in boxes for x, y in markers if line_has_markers(ax, x, y))
    assert any(t.get_text().startswith("matched") for t in ax.texts)
    assert_readable(ad_figures.tradeoff_loss_figure(summary))


def test_attackers_figure_draws_the_shared_control_once():
    fig = ad_figures.attackers_figure(tradeoff_summary())
    assert_readable(fig)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert not any(
        "ADS distribution, temperature sweep" in label for label in labels
    )  # opd is the control there
    assert any("the control" in label for label in labels)


@pytest.mark.parametrize("n", [1, 6])
def test_token_and_sample_pictures_are_readable(n):
    tokens = [{"text": c, "changed": i % 3 == 0} for i, c in enumerate("12+34=46;46")]
    comparison = {
        "prompt": "12+34",
        "lam": 0.1,
        "method": "ads",
        "plain_completion": "12+34=46;46",
        "plain_correct": True,
        "correct": False,
        "tokens": tokens,
    }
    assert_readable(ad_figures.token_changes_figure([comparison] * n))
    sample = {"step": 3, "prompt": "12+34", "tokens": list("12+34=46;46"), "divergence": [0.1] * 11}
    assert_readable(figures.samples_figure([sample] * n))
