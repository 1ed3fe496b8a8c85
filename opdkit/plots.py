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

from opdkit.runs import RunDir  # noqa: E402


def _series(records: list[dict], key: str) -> tuple[list, list]:
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
    """The training curves of `records` on `fig` (cleared; a new one if None); the live view redraws with it."""
    panels = CURVE_PANELS + (
        [("eval_accuracy", "held-out accuracy")] if _series(records, "eval_accuracy")[0] else []
    )
    if fig is None:
        fig = plt.figure(figsize=(4 * len(panels), 3.2))
    fig.clear()
    axes = fig.subplots(1, len(panels))
    for ax, (key, label) in zip(axes, panels):
        x, y = _series(records, key)
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
    vals = [s.get("student_accuracy_before"), s.get("student_accuracy_after"), s.get("teacher_accuracy")]
    fig, ax = plt.subplots(figsize=(5, 3))
    bars = ax.bar(names, [v or 0 for v in vals], color=["#bbb", "#3a7", "#37a"])
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


ARM_COLOURS = {
    "clip": "#2a7",
    "noclip": "#d33",
    "clip-at-noclip-lr": "#e90",
    "noclip-at-clip-lr": "#37c",
    "sgd-clip": "#6b4",
    "sgd-noclip": "#a2a",
}


def lesson_curves(arm_records: dict[str, list[dict]], thresholds: dict[str, float], path=None):
    """Loss per step and pre-clip gradient norm (log scale, each clipped arm's threshold dashed)."""
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(14, 3.8))
    for name, records in arm_records.items():
        colour = ARM_COLOURS.get(name)
        ax_l.plot(*_series(records, "loss"), lw=1.2, label=name, color=colour)
        ax_g.plot(*_series(records, "grad_norm"), lw=1.0, label=name, color=colour)
        thr = thresholds.get(name)
        if thr and math.isfinite(thr) and thr < 1e8:
            ax_g.axhline(thr, color=colour, ls="--", lw=0.8)
    ax_l.set_title("divergence per token (reverse KL)", fontsize=10)
    ax_g.set_title("pre-clip gradient norm; dashed: clip threshold", fontsize=10)
    ax_g.set_yscale("log")
    for ax in (ax_l, ax_g):
        ax.set_xlabel("optimizer step")
    handles, labels = ax_l.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    if path:
        fig.savefig(path, dpi=110)
    return fig


def lesson_accuracy(summary: dict, path=None):
    """Final accuracy per arm (bar: first seed; dots: every seed) with the shared starting accuracy."""
    names = list(summary)
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 2, 3.4))
    for i, name in enumerate(names):
        entry = summary[name]
        ax.bar(i, entry.get("final_accuracy") or 0, color=ARM_COLOURS.get(name, "#888"), alpha=0.8)
        accs = [s.get("final_accuracy") or 0 for s in entry.get("seeds", {}).values()]
        ax.scatter([i] * len(accs), accs, color="k", s=12, zorder=3)
        lr, clip, opt = entry["learning_rate"], entry["clipping"], entry.get("optimizer", "adamw")
        ax.text(
            i, -0.12, f"{opt}\nlr {lr:g}\n{'clip' if clip else 'no clip'}", ha="center", va="top", fontsize=8
        )
    before = next(
        (e.get("accuracy_before") for e in summary.values() if e.get("accuracy_before") is not None), None
    )
    if before is not None:
        ax.axhline(before, color="grey", ls=":", lw=1, label=f"student before ({before:.0%})")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy after")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


ADS_COLOURS = ("#d33", "#e90", "#a2a", "#c60")
TEMPERATURE_COLOUR = "#37a"


def _accuracy_xy(points: Sequence[dict]) -> tuple[list[float], list[float]]:
    kept = [p for p in points if p.get("teacher_accuracy") is not None]
    return [p["teacher_accuracy"] for p in kept], [p["student_accuracy"] for p in kept]


ADS_LABELS = {"ads": "ADS", "ads-answer": "ADS, answer-token gradient"}


def tradeoff_curves(summary: dict) -> dict[str, list[dict]]:
    """The lines of the trade-off figure: the temperature sweep (by τ) and one line per ADS method and ADS
    temperature (by λ), each ADS line starting at the λ = 0 point of its temperature when that was run."""
    points = summary["points"]
    curves = {"temperature": sorted((p for p in points if p["lam"] == 0), key=lambda p: p["temperature"])}
    methods = dict.fromkeys(p["method"] for p in points if p["lam"] != 0)
    for method in methods:
        for tau in sorted({p["temperature"] for p in points if p["method"] == method}):
            start = [p for p in points if p["lam"] == 0 and p["temperature"] == tau]
            line = sorted(
                (p for p in points if p["method"] == method and p["temperature"] == tau),
                key=lambda p: p["lam"],
            )
            curves[f"{ADS_LABELS.get(method, method)} (τ={tau:g})"] = start + line
    return curves


def tradeoff(summary: dict, path=None, title: str = ""):
    """Teacher accuracy (x) against distilled-student accuracy (y), ADS against temperature sampling, as in
    the ADS paper's headline figure: a method is better for the teacher where its curve lies lower at the
    same x (the teacher stays accurate, students distilled from it do not)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for i, (label, line) in enumerate(tradeoff_curves(summary).items()):
        is_temp = label == "temperature"
        colour = TEMPERATURE_COLOUR if is_temp else ADS_COLOURS[(i - 1) % len(ADS_COLOURS)]
        x, y = _accuracy_xy(line)
        ax.plot(x, y, "o-" if is_temp else "s-", color=colour, label=label, lw=1.4, ms=5)
        runs = [r for p in line for r in p.get("runs", []) if len(p.get("runs", [])) > 1]
        if runs:  # every repeat of a point, around the mean the line goes through
            rx, ry = _accuracy_xy(runs)
            ax.scatter(rx, ry, color=colour, s=9, alpha=0.35, marker="o" if is_temp else "s")
        for p in line:
            if p.get("teacher_accuracy") is None or (not is_temp and p["lam"] == 0):
                continue
            tag = f"τ={p['temperature']:g}" if is_temp else f"λ={p['lam']:g}"
            ax.annotate(
                tag,
                (p["teacher_accuracy"], p["student_accuracy"]),
                textcoords="offset points",
                xytext=(4, 4 if is_temp else -10),
                fontsize=7,
                color=colour,
            )
    before = summary.get("student_accuracy_before")
    if before is not None:
        ax.axhline(before, color="grey", ls=":", lw=1, label=f"student before distillation ({before:.0%})")
    ax.plot([0, 1], [0, 1], color="#ccc", lw=0.8, zorder=0)
    xs = [p["teacher_accuracy"] for p in summary["points"] if p.get("teacher_accuracy") is not None]
    ys = [p["student_accuracy"] for p in summary["points"]] + ([before] if before is not None else [])
    if xs:
        ax.set_xlim(max(0.0, min(xs) - 0.05), min(1.0, max(xs) + 0.05))
        ax.set_ylim(max(0.0, min(ys) - 0.05), min(1.02, max(ys) + 0.08))
    ax.set_xlabel("teacher accuracy (its training traces)")
    ax.set_ylabel("distilled student accuracy (held out)")
    ax.set_title(title or "antidistillation sampling vs temperature sampling", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def _token_span(t: dict) -> str:
    text = _html.escape(t["text"].replace("\n", "⏎"))
    if not t["changed"]:
        return f'<span title="p {t["p_ads"]:.3f}" style="font-family:monospace">{text}</span>'
    tip = f"ADS p {t['p_ads']:.3f} (plain p {t['p_plain']:.3f}); plain sampling drew {t['plain_text']!r} (p {t['p_plain_choice']:.3f})"
    return (
        f'<span title="{_html.escape(tip)}" style="font-family:monospace;background:rgba(230,140,20,0.55);'
        f'border-bottom:2px solid #c60">{text}</span>'
    )


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else (" ✓" if ok else " ✗")


def token_changes_html(c: dict) -> str:
    """One comparison from `antidistill.TokenLens.compare`: the plain trace, and the ADS trace drawn with
    the same noise, its changed tokens highlighted (hover for the probabilities and the plain token)."""
    n = sum(t["changed"] for t in c["tokens"])
    plain = _html.escape(c["plain_completion"])
    return (
        f'<div style="margin:6px 0"><b>{_html.escape(c["prompt"])}</b> · {ADS_LABELS.get(c.get("method", "ads"), "ADS")} '
        f"λ {c['lam']:g} · τ {c['temperature']:g} · "
        f"seed {c['seed']} · {n} token(s) changed<br>"
        f'<span style="color:#666">plain&nbsp;</span><span style="font-family:monospace">{plain}</span>'
        f"{_verdict(c['plain_correct'])}<br>"
        f'<span style="color:#666">ADS&nbsp;&nbsp;&nbsp;</span>{"".join(_token_span(t) for t in c["tokens"])}'
        f"{_verdict(c['correct'])}</div>"
    )


def token_changes_figure(comparisons: Sequence[dict], path=None, title: str = "tokens ADS changed"):
    """A static picture of `token_changes_html` for headless runs: per comparison, the plain trace and the
    ADS trace with its changed tokens on orange."""
    rows = list(comparisons)
    fig, ax = plt.subplots(figsize=(12, 0.75 * max(1, len(rows)) + 0.7))
    ax.axis("off")
    for i, c in enumerate(rows):
        y = 1 - (i + 0.5) / max(1, len(rows))
        tag = "answer-grad " if c.get("method") == "ads-answer" else ""
        ax.text(
            0.0,
            y + 0.12 / len(rows),
            f"{prompt_label(c['prompt'], 16)}  {tag}λ={c['lam']:g}",
            fontsize=8,
            family="monospace",
            va="center",
            transform=ax.transAxes,
        )
        ax.text(
            0.2,
            y + 0.15 / len(rows),
            f"plain: {c['plain_completion']}{_verdict(c['plain_correct'])}",
            fontsize=8,
            family="monospace",
            va="center",
            color="#555",
            transform=ax.transAxes,
        )
        x = 0.2
        ax.text(
            x,
            y - 0.12 / len(rows),
            "ADS:",
            fontsize=8,
            family="monospace",
            va="center",
            transform=ax.transAxes,
        )
        x += 0.035
        for t in c["tokens"]:
            s = t["text"].replace("\n", "⏎")
            box = dict(boxstyle="square,pad=0.1", fc="#f0a040", ec="none") if t["changed"] else None
            ax.text(
                x,
                y - 0.12 / len(rows),
                s,
                fontsize=8,
                family="monospace",
                va="center",
                bbox=box,
                transform=ax.transAxes,
            )
            x += 0.0068 * max(1, len(s))
            if x > 0.97:
                break
        ax.text(
            min(x + 0.01, 0.98),
            y - 0.12 / len(rows),
            _verdict(c["correct"]).strip(),
            fontsize=8,
            va="center",
            transform=ax.transAxes,
        )
    ax.set_title(
        f"{title} (orange: a token plain sampling would not have drawn with the same noise)", fontsize=10
    )
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def tradeoff_loss(summary: dict, path=None):
    """Teacher accuracy (x) against the distilled students' NLL on the gradient's held-out traces (y): the
    objective ADS steers by. Higher at the same x: ADS moved the students where its gradient points."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (label, line) in enumerate(tradeoff_curves(summary).items()):
        is_temp = label == "temperature"
        kept = [
            p
            for p in line
            if p.get("teacher_accuracy") is not None and p.get("student_holdout_loss") is not None
        ]
        colour = TEMPERATURE_COLOUR if is_temp else ADS_COLOURS[(i - 1) % len(ADS_COLOURS)]
        ax.plot(
            [p["teacher_accuracy"] for p in kept],
            [p["student_holdout_loss"] for p in kept],
            "o-" if is_temp else "s-",
            color=colour,
            label=label,
            lw=1.4,
            ms=5,
        )
    before = summary.get("student_holdout_loss_before")
    if before is not None:
        ax.axhline(before, color="grey", ls=":", lw=1, label=f"student before distillation ({before:.3f})")
    ax.set_xlabel("teacher accuracy (its training traces)")
    ax.set_ylabel("distilled student's NLL on held-out teacher traces")
    ax.set_title("the proxy objective ADS steers by", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig
