"""Figures and HTML views of a run directory; each figure is also saved under `figures/`.

fig = training_curves(run)                    # loss, pre-clip grad norm, length, entropy, accuracy
html = samples_html(run.read_jsonl("samples.jsonl")[-4:])
"""

from __future__ import annotations

import html as _html
import math
import re
from collections.abc import Sequence

import matplotlib

if matplotlib.get_backend().lower() == "agg" or not matplotlib.get_backend():
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from opdkit.run.folders import RunDir  # noqa: E402


def series(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def training_curves(run: RunDir, max_grad_norm: float | None = None, title: str = ""):
    """Panels from metrics.jsonl: loss, pre-clip gradient norm (log), completion length, entropy, and the
    held-out accuracy measured while training (`eval_accuracy` rows), if any."""
    fig = draw_training_curves(run.read_jsonl(), max_grad_norm, title, _summary_or_empty(run))
    fig.savefig(run.figure("training_curves"), dpi=110)
    return fig


CURVE_PANELS = [
    ("loss", "divergence per token"),
    ("grad_norm", "pre-clip gradient norm"),
    ("completion_length", "mean completion length"),
    ("entropy", "student entropy (nats/token)"),
]


def draw_training_curves(
    records: list[dict],
    max_grad_norm: float | None = None,
    title: str = "",
    summary: dict | None = None,
    fig=None,
):
    """The training curves of `records` on `fig` (cleared; a new one if None); the live view redraws with
    it."""
    panels = CURVE_PANELS + (
        [("eval_accuracy", "held-out accuracy")] if series(records, "eval_accuracy")[0] else []
    )
    if fig is None:
        fig = plt.figure(figsize=(4 * len(panels), 3.2))
    fig.clear()
    axes = fig.subplots(1, len(panels))
    for ax, (key, label) in zip(axes, panels):
        x, y = series(records, key)
        ax.plot(x, y, lw=1.2, marker="o" if key == "eval_accuracy" else None, ms=3)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("optimizer step")
        if key == "grad_norm" and y:
            ax.set_yscale("log")
            if max_grad_norm and math.isfinite(max_grad_norm) and max_grad_norm < 1e8:
                ax.axhline(max_grad_norm, color="red", ls="--", lw=1, label=f"clip at {max_grad_norm:g}")
                ax.legend(fontsize=8)
        if key == "eval_accuracy":
            _accuracy_references(ax, summary or {})
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _accuracy_references(ax, summary: dict) -> None:
    ax.set_ylim(-0.02, 1.02)
    if summary.get("teacher_accuracy") is not None:
        ax.axhline(summary["teacher_accuracy"], color="#37a", ls="--", lw=1, label="teacher")
    if summary.get("student_accuracy_before") is not None:
        ax.plot([0], [summary["student_accuracy_before"]], "s", color="#bbb", label="student before")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def _summary_or_empty(run: RunDir) -> dict:
    return run.read_summary() if (run.path / "summary.json").is_file() else {}


def accuracy_bars(run: RunDir, summary: dict | None = None):
    s = summary or run.read_summary()
    names = ["student before", "student after", "teacher"]
    keys = ["student_accuracy_before", "student_accuracy_after", "teacher_accuracy"]
    colours = ["#bbb", "#3a7", "#37a"]
    if any(s.get(k + "_forced") is not None for k in keys):  # whitebox's forced_accuracy: beside the raw
        names = [n + "\nraw" for n in names] + [n + "\nforced" for n in names]
        keys, colours = keys + [k + "_forced" for k in keys], colours + ["#ddd", "#8c9", "#8ac"]
    vals = [s.get(k) for k in keys]
    fig, ax = plt.subplots(figsize=(5 if len(keys) == 3 else 8, 3))
    bars = ax.bar(names, [v or 0 for v in vals], color=colours)
    for b, v in zip(bars, vals):
        ax.text(
            b.get_x() + b.get_width() / 2, (v or 0) + 0.01, "n/a" if v is None else f"{v:.1%}", ha="center"
        )
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("held-out accuracy")
    if s.get("accuracy_precision"):
        ax.set_title(f"greedy, decoded at {s['accuracy_precision']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(run.figure("accuracy"), dpi=110)
    return fig


def prompt_label(prompt: str, width: int = 40) -> str:
    """The prompt without template tokens, shortened from the left: enough to recognise the problem."""
    text = " ".join(re.sub(r"<\|[^|]*\|>|\b(user|assistant|system)\n", " ", prompt).split())
    return text if len(text) <= width else "…" + text[-width:]


def _colour(value: float, vmax: float) -> str:
    """White (0) to red (vmax) background for a token's divergence."""
    a = 0.0 if vmax <= 0 else min(1.0, max(0.0, value) / vmax)
    return f"rgba(220, 40, 40, {a:.2f})"


def sample_html(sample: dict, vmax: float | None = None) -> str:
    """One completion with each token's background set by its per-token divergence."""
    divs = sample["divergence"]
    vmax = vmax or max(divs + [1e-9])
    spans = "".join(
        f'<span title="{d:.4f}" style="background:{_colour(d, vmax)};font-family:monospace">'
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


def samples_figure(samples: Sequence[dict], path=None, title: str = "sampled completions"):
    """A static picture of `samples_html` for headless runs: one row of coloured tokens per sample."""
    rows = list(samples)
    fig, ax = plt.subplots(figsize=(12, 0.45 * max(1, len(rows)) + 0.6))
    ax.axis("off")
    vmax = max((max(s["divergence"] + [1e-9]) for s in rows), default=1.0)
    cmap = plt.get_cmap("Reds")
    for i, s in enumerate(rows):
        y = 1 - (i + 0.5) / max(1, len(rows))
        label = f"step {s['step']}  {prompt_label(s['prompt'], 18)}"
        ax.text(0.0, y, label, fontsize=8, va="center", family="monospace", transform=ax.transAxes)
        x = 0.2
        for tok, d in zip(s["tokens"], s["divergence"]):
            t = tok.replace("\n", "⏎")
            ax.text(
                x,
                y,
                t,
                fontsize=9,
                va="center",
                family="monospace",
                transform=ax.transAxes,
                bbox=dict(boxstyle="square,pad=0.1", fc=cmap(min(1.0, d / vmax)), ec="none"),
            )
            x += 0.0085 * max(1, len(t))
            if x > 0.98:
                break
    ax.set_title(f"{title} (colour: per-token divergence, max {vmax:.3f})", fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig
