"""What a finished tool-use run shows (notebooks/05_tool_use.ipynb: the whitebox job on a tool `environment`):
before and after, the answer accuracy of greedy episodes and the share of them that call the tools
correctly, with their 95 % intervals over seeds; the findings computed from summary.json; the sampled
transcripts with the tools' turns set apart and the student's tokens coloured by divergence.

    display(HTML(summary_table_html(summary))); bars(run)     # both measures: before / after / teacher
    display(Markdown(explain(summary)))                            # the findings, each with its verdict
    html, fig = transcripts(run, n=4)                              # the last logged episodes
"""

from __future__ import annotations

import html as _html

import matplotlib.pyplot as plt

from opdkit.jobs.whitebox.seeds import seed_runs
from opdkit.notebook import figures as run_figures
from opdkit.notebook import verdicts
from opdkit.run.folders import RunDir

MEASURES = (
    ("answer accuracy", "student_accuracy_before", "student_accuracy_after", "teacher_accuracy"),
    (
        "calls the tool correctly",
        "student_tool_call_share_before",
        "student_tool_call_share_after",
        "teacher_tool_call_share",
    ),
)
GOAL = 0.40  # issue 38's goal for the tiny tool world: the answer accuracy lifted by 40 points or more


def per_seed(summary: dict) -> list[dict]:
    """Each seed's summary (a run with `repeats` keeps them under `seeds`), or the run's own."""
    return list((summary.get("seeds") or {}).values()) or [summary]


def lifts(summary: dict, before: str, after: str) -> list[float]:
    """After minus before, paired by seed."""
    return [
        s[after] - s[before]
        for s in per_seed(summary)
        if s.get(after) is not None and s.get(before) is not None
    ]


def findings(summary: dict) -> list[dict]:
    """05's findings, each judged on its interval over seeds: the student calls the tools correctly more
    often after distillation, its answer accuracy rises, and rises by at least `GOAL`."""
    calls = lifts(summary, "student_tool_call_share_before", "student_tool_call_share_after")
    accuracy = lifts(summary, "student_accuracy_before", "student_accuracy_after")
    return [
        verdicts.verdict("distillation raises the share of episodes that call the tool correctly", calls),
        verdicts.verdict("distillation lifts the answer accuracy of the student's episodes", accuracy),
        verdicts.verdict(f"the lift reaches the goal of {GOAL * 100:.0f} points", accuracy, threshold=GOAL),
    ]


def summary_table_html(summary: dict) -> str:
    """Student before and after and the teacher: answer accuracy and the share of episodes calling the tools
    correctly, in percent with their intervals over seeds."""
    n = summary.get("repeats", 1)
    rows = []
    for label, index in (("student before", 1), ("student after", 2), ("teacher", 3)):
        cells = [
            verdicts.pct_interval(summary.get(m[index]), summary.get(f"{m[index]}_ci"), n) for m in MEASURES
        ]
        rows.append([label, *cells])
    steps = summary.get("steps")
    caption = f"greedy episodes, held out; {steps} steps; " if steps is not None else "greedy episodes; "
    caption += f"mean of {n} seeds [{verdicts.INTERVAL_NAME}]" if n > 1 else "one seed (no interval)"
    head = ["", *(m[0] for m in MEASURES)]
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return (
        f"<table><caption>{caption}</caption><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>"
    )


def explain(summary: dict) -> str:
    """The findings in sentences with their verdicts, then what they rest on."""
    if not summary.get("finding"):
        return "- the run has no finding (it did not finish)."
    n = summary.get("repeats", 1)
    lines = [f"**Finding.** {verdicts.sentence(f)}" for f in findings(summary)]
    get = lambda k: verdicts.pct_interval(summary.get(k), summary.get(f"{k}_ci"), n)  # noqa: E731
    lines += [
        "- the student's episodes call the tool correctly in "
        f"{get('student_tool_call_share_before')} before, "
        f"{get('student_tool_call_share_after')} after; the teacher's in {get('teacher_tool_call_share')}.",
        f"- answer accuracy {get('student_accuracy_before')} before, {get('student_accuracy_after')} after; "
        f"the teacher {get('teacher_accuracy')} (greedy episodes with the tool, held out).",
    ]
    if n < 3:
        lines.append(
            f"- {n} seed{'s' if n != 1 else ''}: no interval; `-p mode tiny-tools-seeds` (or `-p repeats 3`) "
            "gives each finding its interval."
        )
    return "\n".join(lines)


@run_figures.styled
def bars(run: RunDir):
    """The two measures side by side, student before / after and the teacher, with the 95 % interval over
    seeds as error bars."""
    s = run.read_summary()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    names = ["student before", "student after", "teacher"]
    colours = [run_figures.BEFORE, run_figures.STUDENT, run_figures.TEACHER]
    for ax, (label, *keys) in zip(axes, MEASURES):
        run_figures.summary_bars(ax, s, names, keys, colours)
        ax.set_title(label)
        run_figures.percent_axis(ax, top=1.08)
    axes[0].set_ylabel("greedy episodes, held out")
    n = s.get("repeats", 1)
    if n and n > 1:
        fig.suptitle(f"mean of {n} seeds, 95 % interval", fontsize=10)
    fig.tight_layout()
    fig.savefig(run.figure("tool_use"))
    return fig


def transcript_html(sample: dict, vmax: float) -> str:
    """One episode: the student's turns as coloured tokens, the tools' and template's parts in a grey box."""
    out = []
    for part in run_figures.turn_parts(sample):
        if part["sampled"]:
            spans = "".join(
                f'<span title="{d:.4f}" style="background:{run_figures.divergence_colour(d, vmax)}">'
                f"{_html.escape(tok.replace(chr(10), '⏎'))}</span>"
                for tok, d in zip(part["tokens"], part["divergence"])
            )
            out.append(f'<div style="font-family:monospace;margin:2px 0"><b>student</b> {spans}</div>')
        else:
            text = _html.escape(part["text"]).replace("\n", "⏎")
            out.append(
                '<div style="font-family:monospace;margin:2px 0 2px 2em;padding:2px 4px;background:#eef;'
                f'color:#446"><b>tool / template</b> (context, no loss) {text}</div>'
            )
    head = _html.escape(run_figures.prompt_label(sample["prompt"], 80))
    label = f'<b>step {sample["step"]}</b> <span style="color:#666">{head}</span>'
    return f'<div style="margin:8px 0">{label}{"".join(out)}</div>'


def transcripts(run: RunDir, n: int = 4) -> tuple[str, object]:
    """The last `n` logged episodes (the first seed's): an HTML transcript view, tool turns set apart and the
    student's tokens coloured by per-token divergence, and a static figure of the student's tokens."""
    shown = seed_runs(run)[0].read_jsonl("samples.jsonl")[-n:]
    if not shown:
        return run_figures.samples_html(shown), None
    vmax = max(max(s["divergence"] + [1e-9]) for s in shown)
    legend = (
        "<div>the student's tokens: background by per-token divergence, white 0 to red "
        f"{vmax:.3f} (hover for values); the tools' results and the template's tokens between turns are "
        "context and carry no loss</div>"
    )
    html = legend + "".join(transcript_html(s, vmax) for s in shown)
    fig = run_figures.samples_figure(
        shown, path=run.figure("transcripts"), title="the student's sampled episodes", lines_per_sample=6
    )
    return html, fig
