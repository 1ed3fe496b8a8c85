"""Figures and HTML views of antidistillation: the trade-off of teacher against distilled-student
accuracy, and which tokens ADS changed (a figure, HTML, and a widget to explore them); each figure is also
saved where `path` says.

    fig = tradeoff(summary, path=run.figure("tradeoff"))
"""

from __future__ import annotations

import html as _html
from collections.abc import Sequence

from opdkit.jobs.antidistill.config import ATTACKER_NAMES
from opdkit.jobs.antidistill.points import result_key
from opdkit.notebook.figures import plt, prompt_label
from opdkit.notebook.widgets import reporting

ADS_COLOURS = ("#d33", "#e90", "#a2a", "#c60")
TEMPERATURE_COLOUR = "#37a"


RAW, FORCED = "student_accuracy", "student_accuracy_forced"  # a point's two student accuracies


def _accuracy_xy(points: Sequence[dict], key: str = RAW) -> tuple[list[float], list[float]]:
    kept = [p for p in points if p.get("teacher_accuracy") is not None and p.get(key) is not None]
    return [p["teacher_accuracy"] for p in kept], [p[key] for p in kept]


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
    same x (the teacher stays accurate, students distilled from it do not). The students' raw accuracy on
    the left; with their final answers forced (as the ADS reference reports too) beside it, on the right,
    when the run measured it."""
    forced = any(p.get(FORCED) is not None for p in summary["points"])
    fig, axes = plt.subplots(1, 2 if forced else 1, figsize=(12.4 if forced else 6.4, 4.6), squeeze=False)
    panels = ((RAW, "student_accuracy_before", "raw"), (FORCED, "student_accuracy_before_forced", "forced"))
    for ax, (key, before_key, kind) in zip(axes[0], panels):
        _tradeoff_panel(ax, summary, key, summary.get(before_key), kind)
    axes[0][0].set_title(title or "antidistillation sampling vs temperature sampling", fontsize=10)
    if forced:
        axes[0][1].set_title("the same students, each final answer forced", fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def _tradeoff_panel(ax, summary: dict, key: str, before: float | None, kind: str) -> None:
    """One panel of `tradeoff`: the students' `key` accuracy (raw or forced) against teacher accuracy."""
    for i, (label, line) in enumerate(tradeoff_curves(summary).items()):
        is_temp = label == "temperature"
        colour = TEMPERATURE_COLOUR if is_temp else ADS_COLOURS[(i - 1) % len(ADS_COLOURS)]
        x, y = _accuracy_xy(line, key)
        ax.plot(x, y, "o-" if is_temp else "s-", color=colour, label=label, lw=1.4, ms=5)
        runs = [r for p in line for r in p.get("runs", []) if len(p.get("runs", [])) > 1]
        if runs:  # every repeat of a point, around the mean the line goes through
            rx, ry = _accuracy_xy(runs, key)
            ax.scatter(rx, ry, color=colour, s=9, alpha=0.35, marker="o" if is_temp else "s")
        for p in line:
            if p.get("teacher_accuracy") is None or p.get(key) is None or (not is_temp and p["lam"] == 0):
                continue
            tag = f"τ={p['temperature']:g}" if is_temp else f"λ={p['lam']:g}"
            ax.annotate(
                tag,
                (p["teacher_accuracy"], p[key]),
                textcoords="offset points",
                xytext=(4, 4 if is_temp else -10),
                fontsize=7,
                color=colour,
            )
    if before is not None:
        ax.axhline(before, color="grey", ls=":", lw=1, label=f"student before distillation ({before:.0%})")
    ax.plot([0, 1], [0, 1], color="#ccc", lw=0.8, zorder=0)
    xs, ys = _accuracy_xy(summary["points"], key)
    ys += [before] if before is not None else []
    if xs:
        ax.set_xlim(max(0.0, min(xs) - 0.05), min(1.0, max(xs) + 0.05))
        ax.set_ylim(max(0.0, min(ys) - 0.05), min(1.02, max(ys) + 0.08))
    ax.set_xlabel("teacher accuracy (its training traces)")
    ax.set_ylabel(f"distilled student accuracy, {kind} (held out)")
    ax.legend(fontsize=8, loc="upper left")


def _token_span(t: dict) -> str:
    text = _html.escape(t["text"].replace("\n", "⏎"))
    if not t["changed"]:
        return f'<span title="p {t["p_ads"]:.3f}" style="font-family:monospace">{text}</span>'
    tip = (
        f"ADS p {t['p_ads']:.3f} (plain p {t['p_plain']:.3f}); plain sampling drew {t['plain_text']!r} "
        f"(p {t['p_plain_choice']:.3f})"
    )
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
        f'<div style="margin:6px 0"><b>{_html.escape(c["prompt"])}</b> · '
        f"{ADS_LABELS.get(c.get('method', 'ads'), 'ADS')} "
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


def ads_token_explorer(
    compare, prompts: Sequence[str], lams: Sequence[float], methods: Sequence[str] = ("ads",), seed: int = 0
):
    """Pick a prompt, λ, gradient and seed: the plain trace and the ADS trace drawn with the same noise, the
    tokens ADS changed highlighted. `compare(index, lam, seed, method)` is `antidistill.TokenLens.compare`."""
    import ipywidgets as w

    prompt = w.Dropdown(options=[(p, i) for i, p in enumerate(prompts)], value=0, description="prompt")
    lam = w.SelectionSlider(
        options=[float(v) for v in lams], value=float(lams[-1]), description="λ", continuous_update=False
    )
    method = w.Dropdown(options=list(methods), value=methods[0], description="gradient")
    seed_box = w.IntText(value=seed, description="seed", layout=w.Layout(width="160px"))
    out = w.HTML()

    def show(change=None):
        out.value = token_changes_html(compare(prompt.value, lam.value, seed_box.value, method.value))

    errors = w.Output()
    for control in (prompt, lam, method, seed_box):
        control.observe(reporting(errors, show), names="value")
    show()
    return w.VBox([w.HBox([prompt, lam]), w.HBox([method, seed_box]), out, errors])


ATTACKER_COLOURS = {"sft": "#37a", "opd": "#d33", "opd-plain": "#2a2"}
ATTACKER_LABELS = {
    "sft": "SFT on the teacher's traces",
    "opd": "on-policy, scored with the ADS distribution",
    "opd-plain": "on-policy, scored with the plain teacher",
}


def attackers_in(summary: dict) -> list[str]:
    """The attackers whose accuracy the run's points carry, in `ATTACKER_NAMES` order."""
    points = summary.get("points", [])
    return [a for a in ATTACKER_NAMES if any(p.get(result_key(a)) is not None for p in points)]


def attack_rows(summary: dict) -> list[dict]:
    """One row per point: λ, τ, the teacher's accuracy and each attacker's student accuracy."""
    return [
        {
            "name": p["name"],
            "lam": p["lam"],
            "temperature": p["temperature"],
            "teacher_accuracy": p.get("teacher_accuracy"),
            **{a: p.get(result_key(a)) for a in attackers_in(summary)},
        }
        for p in summary["points"]
    ]


def attackers_figure(summary: dict, path=None, title: str = ""):
    """Teacher accuracy under the point's sampling (x) against each attacker's held-out student accuracy
    (y): one colour per attacker; solid squares along λ for ADS, dashed circles along τ for temperature."""
    fig, ax = plt.subplots(figsize=(6.8, 4.8))
    ys: list[float] = []
    for attacker in attackers_in(summary):
        named = False
        key, colour = result_key(attacker), ATTACKER_COLOURS[attacker]
        for label, line in tradeoff_curves(summary).items():
            kept = [p for p in line if p.get("teacher_accuracy") is not None and p.get(key) is not None]
            if not kept:
                continue
            is_temp = label == "temperature"
            x, y = [p["teacher_accuracy"] for p in kept], [p[key] for p in kept]
            ys += y
            name = None if named else ATTACKER_LABELS[attacker]
            named = True
            ax.plot(x, y, "o--" if is_temp else "s-", color=colour, lw=1.3, ms=5, label=name, alpha=0.9)
            for p in kept:
                if not is_temp and p["lam"] != 0:
                    ax.annotate(
                        f"λ={p['lam']:g}",
                        (p["teacher_accuracy"], p[key]),
                        textcoords="offset points",
                        xytext=(4, -10),
                        fontsize=7,
                        color=colour,
                    )
    before = summary.get("student_accuracy_before")
    if before is not None:
        ax.axhline(before, color="grey", ls=":", lw=1, label=f"student before distillation ({before:.0%})")
        ys.append(before)
    xs = [p["teacher_accuracy"] for p in summary["points"] if p.get("teacher_accuracy") is not None]
    if xs and ys:
        ax.set_xlim(max(0.0, min(xs) - 0.05), min(1.0, max(xs) + 0.05))
        ax.set_ylim(max(0.0, min(ys) - 0.05), min(1.02, max(ys) + 0.1))
    ax.set_xlabel("teacher accuracy (its sampled traces)")
    ax.set_ylabel("distilled student accuracy (held out)")
    ax.set_title(title or "each attacker against ADS (solid) and temperature sampling (dashed)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig
