"""What a finished cliplesson lesson shows: arm against arm in a table, curves, accuracies, the
completions around the largest gradient spike, and the lesson's findings in sentences computed from
summary.json, each with its verdict from the interval over seeds.

    display(HTML(summary_table_html(summary))); curves(lesson); accuracy(lesson)
    display(Markdown(explain(summary)))          # the finding first: "holds", "does not hold" or noise
"""

from __future__ import annotations

import math

from opdkit.jobs.cliplesson import figures as lesson_figures
from opdkit.notebook import figures as run_figures
from opdkit.notebook import verdicts, widgets
from opdkit.run.folders import RunDir


def largest_spike(records: list[dict]) -> int | None:
    """The step with the largest pre-clip gradient norm (finite values only)."""
    finite = [r for r in records if r.get("grad_norm") is not None and math.isfinite(r["grad_norm"])]
    return max(finite, key=lambda r: r["grad_norm"])["step"] if finite else None


def arm_records(summary: dict) -> dict[str, list[list[dict]]]:
    """metrics.jsonl of every seed of each arm, keyed by arm name."""
    return {
        name: [RunDir.attach(s["run_dir"]).read_jsonl() for s in e["seeds"].values()]
        for name, e in summary["arms"].items()
    }


def spike_samples(summary: dict, arm: str = "noclip", window: int = 1) -> tuple[int | None, list[dict]]:
    """The arm's largest pre-clip gradient-norm step (first seed) and the completions sampled around it."""
    run = RunDir.attach(summary["arms"][arm]["run_dir"])
    step = largest_spike(run.read_jsonl())
    if step is None:
        return None, []
    near = [s for s in run.read_jsonl("samples.jsonl") if abs(s["step"] - step) <= window]
    return step, near


def _num(v) -> str:
    return "–" if v is None else f"{v:.3g}"


COLUMNS = (
    ("optimizer", "optimizer"),
    ("learning rate", "learning_rate"),
    ("clipping", "clipping"),
    ("median grad norm", "median_grad_norm"),
    ("max grad norm", "max_grad_norm"),
    ("clipped steps", "clipped_steps"),
    ("max loss", "max_loss"),
    ("final loss", "final_loss"),
)


def summary_table_html(summary: dict) -> str:
    """One row per arm: its settings, the seeds' mean of each figure, the final accuracy with its interval."""
    n = summary.get("repeats", 1)
    head = ["arm", *(h for h, _ in COLUMNS), "final accuracy", "non-finite at step"]
    rows = []
    for name, e in summary["arms"].items():
        cells = [str(e[k]) if isinstance(e[k], (bool, str)) else _num(e[k]) for _, k in COLUMNS]
        acc = verdicts.pct_interval(e.get("final_accuracy"), e.get("final_accuracy_ci"), n)
        nonfinite = [s for s in e.get("first_nonfinite_steps", []) if s is not None]
        rows.append([f"<b>{name}</b>", *cells, acc, ", ".join(map(str, nonfinite)) or "–"])
    caption = f"mean of {n} seeds [{verdicts.INTERVAL_NAME}]" if n > 1 else "one seed (no interval)"
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f"<table><caption>{caption}</caption><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>"
    )


def explain(summary: dict) -> str:
    """The lesson in sentences computed from summary.json: the headline finding (clipped against unclipped)
    with its verdict first, then each one-change comparison, then the numbers they rest on."""
    findings, arms = summary.get("findings", []), summary["arms"]
    if not findings:
        return "- no two arms to compare."
    head, rest = findings[0], findings[1:]
    lines = [f"**Finding.** {verdicts.sentence(head)}"]
    lines += [f"- {verdicts.sentence(f)}" for f in rest]
    for name, e in arms.items():
        acc = verdicts.pct_interval(
            e.get("final_accuracy"), e.get("final_accuracy_ci"), summary.get("repeats", 1)
        )
        lines.append(
            f"- {name}: final accuracy {acc}; peak loss {_num(e.get('max_loss'))}, largest pre-clip gradient "
            f"norm {_num(e.get('max_grad_norm'))} (means over seeds)."
        )
    n = summary.get("repeats", 1)
    if n < 3:
        lines.append(
            f"- {n} seed{'s' if n != 1 else ''}: a verdict needs an interval; `-p repeats 3` runs every arm "
            "three times and pairs them by seed."
        )
    return "\n".join(lines)


def curves(lesson: RunDir):
    """Loss and pre-clip gradient norm of every arm (the seeds' mean and band), each clip threshold dotted."""
    summary = lesson.read_summary()
    arms = summary["arms"]
    thresholds = {name: e["max_grad_norm_setting"] for name, e in arms.items()}
    clipping = {name: e["clipping"] for name, e in arms.items()}
    return lesson_figures.lesson_curves(
        arm_records(summary), thresholds, clipping, path=lesson.figure("loss_and_grad_norm")
    )


def accuracy(lesson: RunDir):
    """Final accuracy of every arm: bars at the seeds' mean with its interval, dots for every seed."""
    return lesson_figures.lesson_accuracy(lesson.read_summary()["arms"], path=lesson.figure("final_accuracy"))


def spike(lesson: RunDir, arm: str | None = None, n: int = 8) -> tuple[str, int | None, str, object]:
    """The completions around the unclipped arm's largest spike: (arm, step, HTML, static figure)."""
    arms = lesson.read_summary()["arms"]
    arm = arm or ("noclip" if "noclip" in arms else next(iter(arms)))
    step, near = spike_samples({"arms": arms}, arm)
    fig = run_figures.samples_figure(
        near[:n], path=lesson.figure("spike_samples"), title=f"{arm}, steps around {step}"
    )
    return arm, step, run_figures.samples_html(near[:n]), fig


def arm_samples(lesson: RunDir) -> dict[str, list[dict]]:
    """samples.jsonl of each arm's first seed, for the step browser."""
    return {
        name: RunDir.attach(e["run_dir"]).read_jsonl("samples.jsonl")
        for name, e in lesson.read_summary()["arms"].items()
    }


def step_browser(lesson: RunDir):
    """A view: pick a step, see each arm's completions there side by side."""
    return widgets.arm_step_browser(arm_samples(lesson))


def figures(lesson: RunDir) -> None:
    """Every figure of the lesson, as a headless run keeps them."""
    curves(lesson)
    accuracy(lesson)
    spike(lesson)
