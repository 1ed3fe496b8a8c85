"""What a finished whitebox run shows: its accuracies as a table, its curves, accuracies and sampled
completions, and its finding in sentences computed from summary.json; a run with `repeats` > 1 shows the
mean over its seeds with 95 % intervals (bands on the curves, error bars on the accuracies).

display(HTML(summary_table_html(summary))); curves(run); accuracy(run); html, fig = samples(run)
display(Markdown(explain(summary)))                          # the finding first, then what it rests on
sample_browser(run)                                          # JupyterLab: page through the samples
"""

from __future__ import annotations

from opdkit.jobs.whitebox.seeds import seed_runs
from opdkit.notebook import figures as run_figures
from opdkit.notebook import verdicts, widgets
from opdkit.run.folders import RunDir

ROWS = (
    ("student before", "student_accuracy_before"),
    ("student after", "student_accuracy_after"),
    ("teacher", "teacher_accuracy"),
)


def summary_table_html(summary: dict) -> str:
    """The accuracies (raw, and forced when measured) in percent, with their intervals over seeds."""
    forced = any(summary.get(f"{k}_forced") is not None for _, k in ROWS)
    n = summary.get("repeats", 1)
    head = ["", "held-out accuracy"] + (["answer forced"] if forced else [])
    rows = []
    for label, key in ROWS:
        cells = [
            verdicts.pct_interval(summary.get(k), summary.get(f"{k}_ci"), n) for k in (key, f"{key}_forced")
        ]
        rows.append([label, *cells[: 2 if forced else 1]])
    steps = summary.get("steps")
    caption = f"{steps} steps; " if steps is not None else ""
    caption += f"mean of {n} seeds [{verdicts.INTERVAL_NAME}]" if n > 1 else "one seed (no interval)"
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f"<table><caption>{caption}</caption><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>"
    )


def explain(summary: dict) -> str:
    """The finding in one sentence with its verdict, then what it rests on, from summary.json."""
    f = summary.get("finding") or {}
    if not f:
        return "- the run has no finding (it did not finish)."
    n = summary.get("repeats", 1)
    after = verdicts.pct_interval(
        summary.get("student_accuracy_after"), summary.get("student_accuracy_after_ci"), n
    )
    lines = [
        f"**Finding.** {verdicts.sentence(f)}",
        f"- student {verdicts.pct(summary.get('student_accuracy_before'))} before, {after} after; the "
        f"teacher {verdicts.pct(summary.get('teacher_accuracy'))} (greedy, held out).",
    ]
    if n < 3:
        lines.append(
            f"- {n} seed{'s' if n != 1 else ''}: one run's lift moves by many points with the seed (rollouts "
            "and data order); `-p mode tiny-seeds` (or `-p repeats 3`) gives the lift its interval."
        )
    return "\n".join(lines)


def curves(run: RunDir):
    """Loss, pre-clip gradient norm (with the clip threshold), completion length, entropy and held-out
    accuracy per step; with seeds, their mean and 95 % band."""
    config = run.read_config()
    runs = seed_runs(run)
    n = f" · mean of {len(runs)} seeds" if len(runs) > 1 else ""
    fig = run_figures.training_curves(
        runs, max_grad_norm=config.get("max_grad_norm"), title=f"whitebox · {config.get('mode', '')}{n}"
    )
    fig.savefig(run.figure("training_curves"))
    return fig


def accuracy(run: RunDir):
    """Student before and after distillation, and the teacher, on the held-out problems (error bars: the
    interval over seeds)."""
    return run_figures.accuracy_bars(run.read_summary(), path=run.figure("accuracy"))


def samples(run: RunDir, n: int = 6) -> tuple[str, object]:
    """The last `n` logged completions (the first seed's) coloured by per-token divergence: (HTML, static
    figure)."""
    shown = seed_runs(run)[0].read_jsonl("samples.jsonl")[-n:]
    return run_figures.samples_html(shown), run_figures.samples_figure(shown, path=run.figure("samples"))


def sample_browser(run: RunDir):
    """A view paging through every logged completion (the first seed's)."""
    return widgets.sample_browser(seed_runs(run)[0].read_jsonl("samples.jsonl"))


def figures(run: RunDir) -> None:
    """Every figure of the run, as a headless run keeps them."""
    curves(run)
    accuracy(run)
    samples(run)
