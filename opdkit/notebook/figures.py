"""Figures and HTML views of a run directory; each figure is also saved under `figures/`. One style for every
figure of the kit (`styled`): a colour-blind-safe palette (Okabe and Ito's, `PALETTE`), text that stays
readable at the size JupyterLab shows a figure, units on the axes, accuracies in percent.

fig = training_curves([run])                  # loss, pre-clip grad norm, length, entropy, accuracy
fig = training_curves(seed_runs)              # the same, the mean over seeds with its 95 % band
html = samples_html(run.read_jsonl("samples.jsonl")[-4:])

Pitfalls this module exists for:
- JupyterLab shows a figure at most as wide as its cell (about 1100 px on a laptop): a wider one is scaled
  down, and its 8 pt text becomes 6 px. Figures here are at most `MAX_WIDTH_IN` inches at 100 dpi, their
  smallest text 9 pt (12.5 px); `smallest_text_px` measures it, and the tests hold every figure to 10 px.
- a reference line at 99.7 % on a 0-100 % axis sits on the frame: the axes leave room above 100 %.
- labels on points of several curves collide: `place_labels` moves each one clear of those placed before,
  and `PointLabels` places them only once the lines are all drawn and laid out (both move the points).
"""

from __future__ import annotations

import functools
import html as _html
import math
import re
from collections.abc import Callable, Sequence

import matplotlib

if matplotlib.get_backend().lower() == "agg" or not matplotlib.get_backend():
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import PercentFormatter  # noqa: E402

from opdkit.notebook import verdicts  # noqa: E402
from opdkit.run.folders import RunDir  # noqa: E402

# Okabe & Ito (2008), distinguishable with every common colour-vision deficiency; one place for the kit.
PALETTE = {
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "green": "#009E73",
    "orange": "#E69F00",
    "sky": "#56B4E9",
    "purple": "#CC79A7",
    "yellow": "#F0E442",
    "black": "#000000",
    "grey": "#888888",
}
CYCLE = [PALETTE[c] for c in ("blue", "vermillion", "green", "orange", "sky", "purple", "black")]
TEACHER, STUDENT, BEFORE = PALETTE["blue"], PALETTE["green"], PALETTE["grey"]
MAX_WIDTH_IN = 10.5  # 1050 px at 100 dpi: JupyterLab's cell shows it unscaled on a laptop
DISPLAY_DPI = 100  # matplotlib's figure.dpi, which the inline backend draws at
SAVE_DPI = 110
STYLE = {
    "figure.dpi": DISPLAY_DPI,
    "savefig.dpi": SAVE_DPI,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.titlesize": 12,
    "axes.prop_cycle": matplotlib.cycler(color=CYCLE),
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def styled(fn: Callable) -> Callable:
    """Draw `fn`'s figure in the kit's style (`STYLE`), leaving the caller's matplotlib settings alone."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        # Only the style's own keys are restored afterwards: `plt.rc_context` restores every setting, and
        # would undo what the notebook's backend sets when the first figure starts it (interactive mode,
        # without which the inline backend shows no later figure).
        before = {k: matplotlib.rcParams[k] for k in STYLE}
        matplotlib.rcParams.update(STYLE)
        try:
            return fn(*args, **kwargs)
        finally:
            matplotlib.rcParams.update(before)

    return wrapper


def smallest_text_px(fig, shown_width_px: float = 1100.0) -> float:
    """The smallest visible text of `fig` in screen pixels when JupyterLab shows it `shown_width_px` wide at
    most (a wider figure is scaled down to that width)."""
    fig.canvas.draw()
    width_px = fig.get_figwidth() * DISPLAY_DPI
    scale = min(1.0, shown_width_px / width_px) * DISPLAY_DPI / 72.0
    sizes = [
        t.get_fontsize() * scale
        for t in fig.findobj(matplotlib.text.Text)
        if t.get_visible() and t.get_text().strip()
    ]
    return min(sizes, default=float("inf"))


def percent_axis(ax, axis: str = "y", top: float = 1.0) -> None:
    """Accuracies as percent on `axis` (0 to `top`, with room above 100 % for a line at the top)."""
    (ax.yaxis if axis == "y" else ax.xaxis).set_major_formatter(PercentFormatter(1.0, decimals=0))
    if top is not None:
        (ax.set_ylim if axis == "y" else ax.set_xlim)(0.0, top + 0.08)


class PointLabels:
    """Labels on points of several curves, placed where they collide with no other (`place_labels`) once the
    figure is laid out: added while lines are drawn (`add`), placed after the last line and `tight_layout`
    (`place`), since both move the points on screen and a label placed early ends up on another."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []

    def add(self, ax, xy: Sequence[tuple[float, float]], texts: Sequence[str], colour: str) -> None:
        self.pending.append((ax, list(xy), list(texts), colour))

    def place(self) -> None:
        from matplotlib.transforms import Bbox

        placed: dict = {}
        for ax, xy, _, _ in self.pending:  # the points themselves (their markers) are taken too
            for x, y in ax.transData.transform(xy):
                placed.setdefault(id(ax), []).append(Bbox([[x - 5, y - 5], [x + 5, y + 5]]))
        for ax, xy, texts, colour in self.pending:
            place_labels(ax, xy, texts, colour, placed.setdefault(id(ax), []))
        self.pending.clear()


def place_labels(
    ax, xy: Sequence[tuple[float, float]], texts: Sequence[str], colour: str, placed: list
) -> None:
    """Annotate each point with its text at the nearest of `LABEL_SPOTS` (rings of 8 directions, farther out
    each ring) whose box overlaps neither another label in `placed` (the boxes placed so far, shared across
    calls) nor the axes' edge; where every spot is taken, at the one overlapping the others least."""
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)

    def overlap(box) -> float:
        return sum(
            max(0.0, min(box.x1, b.x1) - max(box.x0, b.x0)) * max(0.0, min(box.y1, b.y1) - max(box.y0, b.y0))
            for b in placed
        )

    for (x, y), text in zip(xy, texts):
        best = None
        for dx, dy in LABEL_SPOTS:
            note = ax.annotate(
                text,
                (x, y),
                textcoords="offset points",
                xytext=(dx, dy),
                fontsize=9,
                color=colour,
                ha="right" if dx < 0 else "left",
                va="top" if dy < 0 else "bottom",
            )
            box = note.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            cost = overlap(box) + (0.0 if inside else 1e9)
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, note, box)
            else:
                note.remove()
            if cost == 0:
                break
        placed.append(best[2])


# Where `place_labels` tries a label, in offset points from its point: 8 directions, nearest ring first.
LABEL_SPOTS = [
    (round(r * dx), round(r * dy))
    for r in (6, 14, 24, 36)
    for dx, dy in ((1, -1), (1, 1), (-1, -1), (-1, 1), (0.3, -1.2), (0.3, 1.2), (1.4, 0), (-1.4, 0))
]


def series(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def band_series(runs: Sequence[list[dict]], key: str) -> tuple[list, list, list, list]:
    """Steps logged by every run, and per step the mean of `key` over the runs with its 95 % interval."""
    by_run = [dict(zip(*series(records, key))) for records in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_run))) if by_run else []
    stats = [verdicts.interval([d[s] for d in by_run]) for s in steps]
    return steps, [i.mean for i in stats], [i.low for i in stats], [i.high for i in stats]


def training_curves(runs: Sequence[RunDir], max_grad_norm: float | None = None, title: str = ""):
    """Panels from each run's metrics.jsonl: loss, pre-clip gradient norm (log), completion length, entropy,
    and the held-out accuracy measured while training (`eval_accuracy` rows), if any; with several runs
    (seeds) each panel is their mean with its 95 % band. Saved as the first run's parent's figure."""
    records = [r.read_jsonl() for r in runs]
    summaries = [_summary_or_empty(r) for r in runs]
    reference = {k: verdicts.interval([s.get(k) for s in summaries]) for k in REFERENCES}
    fig = draw_training_curves(records, max_grad_norm, title, {k: v.mean for k, v in reference.items() if v})
    return fig


CURVE_PANELS = [
    ("loss", "divergence per token", "nats / token"),
    ("grad_norm", "pre-clip gradient norm", "L2 norm (log scale)"),
    ("completion_length", "mean completion length", "tokens"),
    ("entropy", "student entropy", "nats / token"),
]
ACCURACY_PANEL = ("eval_accuracy", "held-out accuracy while training", "greedy accuracy")
TOOL_PANEL = ("eval_tool_call_share", "episodes calling the tool correctly", "share of greedy episodes")
SHARE_PANELS = ("eval_accuracy", "eval_tool_call_share")  # drawn as shares, with markers
REFERENCES = ("teacher_accuracy", "student_accuracy_before")


@styled
def draw_training_curves(
    runs: Sequence[list[dict]],
    max_grad_norm: float | None = None,
    title: str = "",
    reference: dict | None = None,
    fig=None,
):
    """The training curves of `runs` (each a run's metrics records; several: their mean and 95 % band) on
    `fig` (cleared; a new one if None), three panels a row; `reference` holds the teacher's accuracy and the
    student's before training, drawn on the accuracy panel. The live view redraws with it."""
    runs = [r for r in runs if r]
    panels = CURVE_PANELS + [p for p in (ACCURACY_PANEL, TOOL_PANEL) if any(series(r, p[0])[0] for r in runs)]
    cols, rows = 3, -(-len(panels) // 3)
    size = (MAX_WIDTH_IN, 2.9 * rows + (0.4 if title else 0))
    fig = plt.figure(figsize=size) if fig is None else fig
    fig.clear()
    fig.set_size_inches(*size)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    for ax, (key, label, unit) in zip(axes, panels):
        colour = STUDENT if key in SHARE_PANELS else PALETTE["blue"]
        marker = "o" if key in SHARE_PANELS else None
        if len(runs) > 1:
            x, mean, low, high = band_series(runs, key)
            ax.plot(x, mean, lw=1.3, color=colour, marker=marker, ms=3, label=f"mean of {len(runs)} seeds")
            ax.fill_between(x, low, high, color=colour, alpha=0.25, lw=0, label="95 % interval")
        elif runs:
            ax.plot(*series(runs[0], key), lw=1.2, color=colour, marker=marker, ms=3)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(unit)
        if key == "grad_norm" and any(series(r, key)[0] for r in runs):
            ax.set_yscale("log")
            if max_grad_norm and math.isfinite(max_grad_norm) and max_grad_norm < 1e8:
                ax.axhline(
                    max_grad_norm,
                    color=PALETTE["vermillion"],
                    ls="--",
                    lw=1,
                    label=f"clip at {max_grad_norm:g}",
                )
        if key == "eval_accuracy":
            _accuracy_references(ax, reference or {})
        elif key == "eval_tool_call_share":
            percent_axis(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _accuracy_references(ax, reference: dict) -> None:
    percent_axis(ax)
    teacher, before = reference.get("teacher_accuracy"), reference.get("student_accuracy_before")
    if teacher is not None:
        ax.axhline(teacher, color=TEACHER, ls="--", lw=1.2, label=f"teacher ({verdicts.pct(teacher)})")
    if before is not None:
        ax.axhline(before, color=BEFORE, ls=":", lw=1.2, label=f"student before ({verdicts.pct(before)})")


def _summary_or_empty(run: RunDir) -> dict:
    return run.read_summary() if (run.path / "summary.json").is_file() else {}


@styled
def accuracy_bars(summary: dict, path=None):
    """Student before and after, and the teacher (raw, and forced beside it when measured): bars at the
    mean, with the 95 % interval over seeds as error bars when the summary has one (`<key>_ci`)."""
    s = summary
    names = ["student before", "student after", "teacher"]
    keys = ["student_accuracy_before", "student_accuracy_after", "teacher_accuracy"]
    colours = [BEFORE, STUDENT, TEACHER]
    if any(s.get(k + "_forced") is not None for k in keys):  # whitebox's forced_accuracy: beside the raw
        names = [n + "\nraw" for n in names] + [n + "\nforced" for n in names]
        keys, colours = keys + [k + "_forced" for k in keys], colours * 2
    fig, ax = plt.subplots(figsize=(5.5 if len(keys) == 3 else 9, 3.4))
    bars = summary_bars(ax, s, names, keys, colours)
    for b in bars[3:]:  # the forced accuracies: hatched beside the raw ones
        b.set_hatch("//")
        b.set_alpha(0.7)
    percent_axis(ax, top=1.05)
    ax.set_ylabel("held-out accuracy (greedy)")
    n = s.get("repeats", 1)
    note = f"; mean of {n} seeds, 95 % interval" if n and n > 1 else ""
    if s.get("accuracy_precision"):
        ax.set_title(f"decoded at {s['accuracy_precision']}{note}", fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path)
    return fig


def summary_bars(ax, summary: dict, names: Sequence[str], keys: Sequence[str], colours: Sequence) -> list:
    """Bars of the summary's `keys` at their means, labelled in percent, with the 95 % interval over seeds as
    error bars where the summary has one (`<key>_ci`); the bars."""
    vals = [summary.get(k) for k in keys]
    bars = ax.bar(names, [v or 0 for v in vals], color=colours)
    for b, k, v in zip(bars, keys, vals):
        ci = summary.get(f"{k}_ci")
        if ci and v is not None:
            ax.errorbar(
                b.get_x() + b.get_width() / 2,
                v,
                yerr=[[v - ci[0]], [ci[1] - v]],
                color="black",
                capsize=4,
                lw=1,
            )
        top = ci[1] if ci else (v or 0)
        ax.text(b.get_x() + b.get_width() / 2, top + 0.02, verdicts.pct(v), ha="center", fontsize=9)
    return list(bars)


def prompt_label(prompt: str, width: int = 40) -> str:
    """The prompt without template tokens, shortened from the left: enough to recognise the problem."""
    text = " ".join(re.sub(r"<\|[^|]*\|>|\b(user|assistant|system)\n", " ", prompt).split())
    return text if len(text) <= width else "…" + text[-width:]


def divergence_colour(value: float, vmax: float) -> str:
    """White (0) to red (vmax) background for a token's divergence."""
    a = 0.0 if vmax <= 0 else min(1.0, max(0.0, value) / vmax)
    return f"rgba(220, 40, 40, {a:.2f})"


def sample_html(sample: dict, vmax: float | None = None) -> str:
    """One completion with each token's background set by its per-token divergence."""
    divs = sample["divergence"]
    vmax = vmax or max(divs + [1e-9])
    spans = "".join(
        f'<span title="{d:.4f}" style="background:{divergence_colour(d, vmax)};font-family:monospace">'
        f"{_html.escape(tok.replace(chr(10), '⏎'))}</span>"
        for tok, d in zip(sample["tokens"], divs)
    )
    head = _html.escape(prompt_label(sample["prompt"], 80))
    return (
        f'<div style="margin:4px 0"><b>step {sample["step"]}</b> <span style="color:#666">{head}</span>'
        f"<br>{spans} <span style='color:#666'>(max {max(divs + [0]):.3f})</span></div>"
    )


def samples_html(samples: Sequence[dict]) -> str:
    if not samples:
        return "<i>no samples logged (sample_every = 0, or the run was shorter than one interval)</i>"
    vmax = max(max(s["divergence"] + [1e-9]) for s in samples)
    legend = f"<div>token background: per-token divergence, white 0 to red {vmax:.3f}; hover for values</div>"
    return legend + "".join(sample_html(s, vmax) for s in samples)


def turn_parts(sample: dict) -> list[dict]:
    """A logged sample as its parts in order: the student's turns with their tokens and divergences, and
    between them the template's and tools' text (`sampled` False; samples.jsonl's `turns`). A single-turn
    sample is one student part."""
    tokens, divs = sample["tokens"], sample["divergence"]
    turns = sample.get("turns") or [{"sampled": True, "text": "", "n_tokens": len(tokens)}]
    parts, at = [], 0
    for t in turns:
        if t["sampled"]:
            n = t.get("n_tokens", len(tokens) - at)
            parts.append({"sampled": True, "tokens": tokens[at : at + n], "divergence": divs[at : at + n]})
            at += n
        else:
            parts.append({"sampled": False, "text": t["text"]})
    return parts


@styled
def samples_figure(
    samples: Sequence[dict], path=None, title: str = "sampled completions", lines_per_sample: int = 1
):
    """A static picture of `samples_html` for headless runs: each sample's label, then its tokens coloured by
    divergence on up to `lines_per_sample` wrapped lines (the rest cut, marked `…`). A multi-turn sample's
    parts follow in order (`turn_parts`): the student's turns coloured, the tools' results and the template
    between them in grey on their own line, so a call, the tool's result and the answer can be read."""
    rows = list(samples)
    vmax = max((max(s["divergence"] + [1e-9]) for s in rows), default=1.0)
    left, right = 0.25, 0.98
    line_in = 0.24
    # Lay every sample out first (its lines of (text, colour or None)), then size the figure to them.
    fig = plt.figure(figsize=(MAX_WIDTH_IN, 1.0))
    char = 0.62 * 9 / 72 / MAX_WIDTH_IN  # a 9 pt monospace character, in figure widths
    laid = [_lay_out(s, char, left, right, lines_per_sample) for s in rows]
    n_lines = sum(max(1, len(lines)) for lines in laid) + 0.5 * max(0, len(rows) - 1)
    height = line_in * max(1, n_lines) + 0.7
    fig.set_size_inches(MAX_WIDTH_IN, height)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1 - 0.55 / height))
    ax.axis("off")
    cmap = plt.get_cmap("Reds")
    y_step = line_in / (height - 0.55)
    y = 1 - y_step / 2
    for s, lines in zip(rows, laid):
        label = f"step {s['step']}  {prompt_label(s['prompt'], 14)}"
        ax.text(0.0, y, label, fontsize=9, va="center", family="monospace", transform=ax.transAxes)
        for line in lines or [[]]:
            for x, text, d in line:
                box = (
                    dict(boxstyle="square,pad=0.1", fc=cmap(min(1.0, d / vmax)), ec="none")
                    if d is not None
                    else dict(boxstyle="square,pad=0.1", fc="#eef", ec="none")
                )
                ax.text(
                    x,
                    y,
                    text,
                    fontsize=9,
                    va="center",
                    family="monospace",
                    transform=ax.transAxes,
                    color="#446" if d is None else "black",
                    bbox=box,
                )
            y -= y_step
        y -= y_step / 2
    grey = "; grey: the tools' results and the template, no loss" if any(s.get("turns") for s in rows) else ""
    fig.suptitle(
        f"{title} (colour: per-token divergence, max {vmax:.3f} nats{grey})", fontsize=11, y=1 - 0.15 / height
    )
    if path:
        fig.savefig(path)
    return fig


def _lay_out(sample: dict, char: float, left: float, right: float, max_lines: int) -> list[list]:
    """`samples_figure`'s lines for one sample: each a list of (x, text, divergence; None for the tools' and
    template's text), wrapped at `right`, at most `max_lines`, a cut line ending in `…`."""
    lines: list[list] = [[]]
    x = left

    def put(text: str, d: float | None, gap: float = 0.4) -> bool:
        nonlocal x
        width = char * (max(1, len(text)) + gap)
        if x + width > right and lines[-1]:
            if len(lines) == max_lines:
                lines[-1].append((x, "…", None))
                return False
            lines.append([])
            x = left
        lines[-1].append((x, text, d))
        x += width
        return True

    for part in turn_parts(sample):
        if part["sampled"]:
            for tok, d in zip(part["tokens"], part["divergence"]):
                if not put(tok.replace("\n", "⏎"), d):
                    return lines
        else:  # the tools' result and the template between turns: context, on a line of its own
            if lines[-1] and len(lines) == max_lines:
                lines[-1].append((x, "…", None))
                return lines
            if lines[-1]:
                lines.append([])
            x = left
            for word in part["text"].replace("\n", " ⏎ ").split():
                if not put(word, None, gap=1.5):
                    return lines
            if len(lines) == max_lines:
                return lines
            lines.append([])
            x = left
    return [line for line in lines if line]
