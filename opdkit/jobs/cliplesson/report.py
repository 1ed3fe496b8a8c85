"""What a finished cliplesson lesson shows: arm against arm in a table, curves, accuracies, the
completions around the largest gradient spike, and the lesson in sentences built from the numbers.

    display(HTML(summary_table_html(summary))); curves(lesson); accuracy(lesson); explain(summary)
"""

from __future__ import annotations

import math

from opdkit.jobs.cliplesson import figures as lesson_figures
from opdkit.notebook import figures as run_figures
from opdkit.notebook import widgets
from opdkit.run.folders import RunDir


def largest_spike(records: list[dict]) -> int | None:
    """The step with the largest pre-clip gradient norm (finite values only)."""
    finite = [r for r in records if r.get("grad_norm") is not None and math.isfinite(r["grad_norm"])]
    return max(finite, key=lambda r: r["grad_norm"])["step"] if finite else None


def arm_records(summary: dict) -> dict[str, list[dict]]:
    """metrics.jsonl of each arm's first seed, keyed by arm name."""
    return {name: RunDir.attach(e["run_dir"]).read_jsonl() for name, e in summary.items()}


def spike_samples(summary: dict, arm: str = "noclip", window: int = 1) -> tuple[int | None, list[dict]]:
    """The arm's largest pre-clip gradient-norm step and the completions sampled around it."""
    run = RunDir.attach(summary[arm]["run_dir"])
    step = largest_spike(run.read_jsonl())
    if step is None:
        return None, []
    near = [s for s in run.read_jsonl("samples.jsonl") if abs(s["step"] - step) <= window]
    return step, near


def _fmt(v, pct=False) -> str:
    if v is None:
        return "–"
    return f"{v:.0%}" if pct else f"{v:.3g}"


def summary_table_html(summary: dict) -> str:
    cols = [
        "optimizer",
        "learning_rate",
        "clipping",
        "median_grad_norm",
        "max_grad_norm",
        "clipped_steps",
        "max_loss",
        "final_loss",
        "final_accuracy",
        "first_nonfinite_step",
    ]
    head = "".join(f"<th>{c}</th>" for c in ["arm", *cols])
    rows = []
    for name, e in summary.items():
        cells = [
            _fmt(e[c], pct=c == "final_accuracy") if isinstance(e[c], float) else str(e[c]) for c in cols
        ]
        rows.append(f"<tr><td><b>{name}</b></td>{''.join(f'<td>{c}</td>' for c in cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def explain(summary: dict) -> str:
    """What this run showed, arm against arm, in plain sentences built from the measured numbers."""
    lines = []

    def line(a: str, b: str, what: str) -> None:
        if a in summary and b in summary:
            x, y = summary[a], summary[b]
            lines.append(
                f"- **{a} vs {b}** ({what}): final accuracy {_fmt(x['final_accuracy'], True)} vs "
                f"{_fmt(y['final_accuracy'], True)}; "
                f"peak loss {_fmt(x['max_loss'])} vs {_fmt(y['max_loss'])}; "
                f"largest pre-clip gradient norm {_fmt(x['max_grad_norm'])} vs {_fmt(y['max_grad_norm'])}."
            )

    line("clip", "noclip", "the original's two arms: clipping and learning rate both change")
    line("clip", "clip-at-noclip-lr", "same clipping, learning rate raised: the learning rate's share")
    line("clip", "noclip-at-clip-lr", "same learning rate, clipping off: the clipping's share")
    line("sgd-clip", "sgd-noclip", "SGD with momentum, same learning rate: clipping alone")
    seeds = {n: [s.get("final_accuracy") for s in e.get("seeds", {}).values()] for n, e in summary.items()}
    if any(len(v) > 1 for v in seeds.values()):
        lines.append(
            "- per seed: " + "; ".join(f"{n} {[_fmt(a, True) for a in v]}" for n, v in seeds.items())
        )
    return "\n".join(lines)


def curves(lesson: RunDir):
    """Loss and pre-clip gradient norm of every arm (first seed), with each arm's clip threshold."""
    summary = lesson.read_summary()
    thresholds = {name: e["max_grad_norm_setting"] for name, e in summary.items()}
    return lesson_figures.lesson_curves(
        arm_records(summary), thresholds, path=lesson.figure("loss_and_grad_norm")
    )


def accuracy(lesson: RunDir):
    """Final accuracy of every arm: bars for the first seed, dots for every seed."""
    return lesson_figures.lesson_accuracy(lesson.read_summary(), path=lesson.figure("final_accuracy"))


def spike(lesson: RunDir, arm: str | None = None, n: int = 8) -> tuple[str, int | None, str, object]:
    """The completions around the unclipped arm's largest spike: (arm, step, HTML, static figure)."""
    summary = lesson.read_summary()
    arm = arm or ("noclip" if "noclip" in summary else next(iter(summary)))
    step, near = spike_samples(summary, arm)
    fig = run_figures.samples_figure(
        near[:n], path=lesson.figure("spike_samples"), title=f"{arm}, steps around {step}"
    )
    return arm, step, run_figures.samples_html(near[:n]), fig


def arm_samples(lesson: RunDir) -> dict[str, list[dict]]:
    """samples.jsonl of each arm's first seed, for the step browser."""
    return {
        name: RunDir.attach(e["run_dir"]).read_jsonl("samples.jsonl")
        for name, e in lesson.read_summary().items()
    }


def step_browser(lesson: RunDir):
    """A widget: pick a step, see each arm's completions there side by side (JupyterLab)."""
    return widgets.arm_step_browser(arm_samples(lesson))


def figures(lesson: RunDir) -> None:
    """Every figure of the lesson, as a headless run keeps them."""
    curves(lesson)
    accuracy(lesson)
    spike(lesson)
