"""antidistill's figures, drawn from summary.json: the trade-off (teacher against distilled-student accuracy,
ADS against temperature sampling, as the ADS paper's headline figure), the students' held-out NLL, each
attacker, and the tokens ADS changed. Every point is the mean over its seeds with its 95 % interval as error
bars; the undistilled student's accuracy, where each line crosses it (the paper's measure) and the matched
teacher accuracy are marked.

    fig = tradeoff_figure(summary, path=run.figure("tradeoff"))
"""

from __future__ import annotations

from collections.abc import Sequence

from opdkit.jobs.antidistill import findings as fd
from opdkit.jobs.antidistill.config import ATTACKER_NAMES
from opdkit.jobs.antidistill.points import result_key
from opdkit.notebook import verdicts
from opdkit.notebook.figures import (
    BEFORE,
    MAX_WIDTH_IN,
    PALETTE,
    PointLabels,
    percent_axis,
    plt,
    prompt_label,
    styled,
)

LINE_COLOURS = (PALETTE["vermillion"], PALETTE["orange"], PALETTE["purple"], PALETTE["sky"], PALETTE["black"])
TEMPERATURE_COLOUR = PALETTE["blue"]
ATTACKER_COLOURS = {"sft": PALETTE["blue"], "opd": PALETTE["vermillion"], "opd-plain": PALETTE["green"]}
ATTACKER_LABELS = {
    "sft": "SFT on the teacher's traces",
    "opd": "on-policy, scored with the ADS distribution",
    "opd-plain": "on-policy, scored with the plain teacher (the control)",
}
RAW, FORCED = "student_accuracy", "student_accuracy_forced"
TEACHER_AXIS = "teacher accuracy on its training traces"


def line_styles(summary: dict) -> dict[str, dict]:
    """Each line's colour and marker: temperature blue circles, each ADS line its own colour, squares."""
    out, i = {}, 0
    for label in fd.lines(summary["points"]):
        if label == "temperature":
            out[label] = {"color": TEMPERATURE_COLOUR, "marker": "o", "ls": "--"}
        else:
            out[label] = {"color": LINE_COLOURS[i % len(LINE_COLOURS)], "marker": "s", "ls": "-"}
            i += 1
    return out


def _xerr(p: dict, key: str) -> list[list[float]] | None:
    ci = p.get(f"{key}_ci")
    return None if not ci else [[p[key] - ci[0]], [ci[1] - p[key]]]


def _draw_line(ax, line: list[dict], key: str, style: dict, label: str) -> list[dict]:
    kept = [p for p in line if p.get("teacher_accuracy") is not None and p.get(key) is not None]
    x, y = [p["teacher_accuracy"] for p in kept], [p[key] for p in kept]
    ax.plot(x, y, color=style["color"], ls=style["ls"], marker=style["marker"], lw=1.4, ms=5, label=label)
    for p in kept:
        xe, ye = _xerr(p, "teacher_accuracy"), _xerr(p, key)
        if xe or ye:
            ax.errorbar(
                p["teacher_accuracy"], p[key], xerr=xe, yerr=ye, color=style["color"], lw=1, capsize=2
            )
    return kept


@styled
def tradeoff_figure(summary: dict, path=None, title: str = ""):
    """Teacher accuracy (x) against distilled-student accuracy (y), ADS against temperature sampling: a method
    is better for the teacher where its line lies lower at the same x. Raw accuracy on the left; with the
    final answers forced (as the ADS reference reports too) on the right, when measured. Error bars: 95 %
    intervals over seeds; ×: where a line falls to the undistilled student (its interval as a bar)."""
    forced = any(p.get(FORCED) is not None for p in summary["points"])
    n = 2 if forced else 1
    fig, axes = plt.subplots(1, n, figsize=(MAX_WIDTH_IN if forced else 6.4, 5.2), squeeze=False)
    panels = (
        (RAW, "student_accuracy_before", "raw"),
        (FORCED, "student_accuracy_before_forced", "answer forced"),
    )
    labels_on_points = PointLabels()
    for ax, (key, before_key, kind) in zip(axes[0], panels):
        _tradeoff_panel(ax, summary, key, summary.get(before_key), kind, labels_on_points)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), frameon=False)
    seeds = summary.get("repeats") or fd.findings(summary).get("seeds", 1)
    note = f"mean of {seeds} seeds, bars: 95 % interval" if seeds and seeds > 1 else "one seed, no interval"
    fig.suptitle(title or f"antidistillation sampling against temperature sampling ({note})")
    fig.tight_layout(rect=(0, 0.1 + 0.03 * ((len(labels) - 1) // 3), 1, 1))
    labels_on_points.place()
    if path:
        fig.savefig(path)
    return fig


def _tradeoff_panel(
    ax, summary: dict, key: str, before: float | None, kind: str, labels_on_points: PointLabels
) -> None:
    styles = line_styles(summary)
    points = summary["points"]
    for label, line in fd.lines(points).items():
        kept = _draw_line(ax, line, key, styles[label], label)
        is_temp = label == "temperature"
        tagged = [p for p in kept if is_temp or p["lam"] != 0]
        texts = [f"τ={p['temperature']:g}" if is_temp else f"λ={p['lam']:g}" for p in tagged]
        xy = [(p["teacher_accuracy"], p[key]) for p in tagged]
        labels_on_points.add(ax, xy, texts, styles[label]["color"])
    if before is not None:
        ax.axhline(
            before,
            color=BEFORE,
            ls=":",
            lw=1.2,
            label=f"student before distillation ({verdicts.pct(before)})",
        )
        for c in fd.crossings(points, before, key):
            if c["mean"] is not None:
                xerr = None if not c["ci"] else [[c["mean"] - c["ci"][0]], [c["ci"][1] - c["mean"]]]
                colour = styles[c["label"]]["color"]
                ax.errorbar(c["mean"], before, xerr=xerr, color=colour, marker="X", ms=9, capsize=3, lw=1.5)
    m = fd.matched(points, key)
    if m:
        ax.axvline(m["teacher_accuracy"], color=PALETTE["grey"], ls="-.", lw=1, alpha=0.8)
        ax.annotate(
            f"matched: {verdicts.pct(m['teacher_accuracy'], 0)}",
            (m["teacher_accuracy"], 0.02),
            xycoords=("data", "axes fraction"),
            textcoords="offset points",
            xytext=(4, 0),
            fontsize=9,
            color=PALETTE["grey"],
        )
    ax.plot([0, 1], [0, 1], color="#ddd", lw=0.8, zorder=0)
    xs = [p["teacher_accuracy"] for p in points if p.get("teacher_accuracy") is not None]
    ys = [p[key] for p in points if p.get(key) is not None] + ([before] if before is not None else [])
    if xs and ys:
        ax.set_xlim(max(0.0, min(xs) - 0.06), min(1.02, max(xs) + 0.06))
        ax.set_ylim(max(0.0, min(ys) - 0.08), min(1.05, max(ys) + 0.1))
    percent_axis(ax, "x", top=None)
    percent_axis(ax, "y", top=None)
    ax.set_xlabel(f"{TEACHER_AXIS} (%)")
    ax.set_ylabel(f"distilled student accuracy, {kind}, held out (%)")


@styled
def tradeoff_loss_figure(summary: dict, path=None):
    """Teacher accuracy (x) against the distilled students' NLL on the gradient's held-out traces (y): the
    objective ADS steers by. Higher at the same x: ADS moved the students where its gradient points."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = line_styles(summary)
    for label, line in fd.lines(summary["points"]).items():
        _draw_line(ax, line, "student_holdout_loss", styles[label], label)
    before = summary.get("student_holdout_loss_before")
    if before is not None:
        ax.axhline(before, color=BEFORE, ls=":", lw=1.2, label=f"student before distillation ({before:.3f})")
    percent_axis(ax, "x", top=None)
    ax.set_xlabel(f"{TEACHER_AXIS} (%)")
    ax.set_ylabel("student NLL on held-out teacher traces\n(nats / token)")
    ax.set_title("the proxy objective ADS steers by")
    ax.legend(loc="best")
    fig.tight_layout()
    if path:
        fig.savefig(path)
    return fig


def attackers_in(summary: dict) -> list[str]:
    """The attackers whose accuracy the run's points carry, in `ATTACKER_NAMES` order."""
    points = summary.get("points", [])
    return [a for a in ATTACKER_NAMES if any(p.get(result_key(a)) is not None for p in points)]


@styled
def attackers_figure(summary: dict, path=None, title: str = ""):
    """Teacher accuracy under the point's sampling (x) against each attacker's held-out student accuracy (y),
    one colour per attacker: SFT along every line; the ADS-scored on-policy student along the ADS lines only
    (at λ = 0 it is the control); the plain-scored control along the temperature sweep, and, where the ADS
    lines run, as a band: one student per τ and seed, shared by every λ."""
    from opdkit.jobs.antidistill.points import result_key

    fig, ax = plt.subplots(figsize=(8.5, 5.4))
    found, labels_on_points = attackers_in(summary), PointLabels()
    for label, line in fd.lines(summary["points"]).items():
        is_temp = label == "temperature"
        for attacker in found:
            if (attacker == "opd" and is_temp) or (attacker == "opd-plain" and not is_temp):
                continue
            key = result_key(attacker)
            style = {
                "color": ATTACKER_COLOURS[attacker],
                "marker": "o" if is_temp else "s",
                "ls": "--" if is_temp else "-",
            }
            name = f"{ATTACKER_LABELS[attacker]}, {'temperature sweep' if is_temp else label}"
            kept = _draw_line(ax, line, key, style, name)
            if not is_temp and attacker == "opd":
                tagged = [p for p in kept if p["lam"] != 0]
                xy = [(p["teacher_accuracy"], p[key]) for p in tagged]
                labels_on_points.add(ax, xy, [f"λ={p['lam']:g}" for p in tagged], style["color"])
        if not is_temp and "opd-plain" in found:
            control = next(
                (p for p in line if p["lam"] == 0 and p.get(result_key("opd-plain")) is not None), None
            )
            if control is not None:
                key = result_key("opd-plain")
                xs = [p["teacher_accuracy"] for p in line if p.get("teacher_accuracy") is not None]
                ci = control.get(f"{key}_ci") or [control[key]] * 2
                ax.fill_between(
                    [min(xs), max(xs)], ci[0], ci[1], color=ATTACKER_COLOURS["opd-plain"], alpha=0.15, lw=0
                )
                ax.hlines(control[key], min(xs), max(xs), color=ATTACKER_COLOURS["opd-plain"], lw=1, ls=":")
    before = summary.get("student_accuracy_before")
    if before is not None:
        ax.axhline(
            before,
            color=BEFORE,
            ls=":",
            lw=1.2,
            label=f"student before distillation ({verdicts.pct(before)})",
        )
    percent_axis(ax, "x", top=None)
    percent_axis(ax, "y", top=None)
    ax.set_xlabel(f"{TEACHER_AXIS} (%)")
    ax.set_ylabel("distilled student accuracy, held out (%)")
    ax.set_title(title or "each attacker; green band: the control shared by every λ of its τ")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    fig.tight_layout()
    labels_on_points.place()
    if path:
        fig.savefig(path, bbox_inches="tight")
    return fig


VERDICT_COLOURS = {verdicts.HOLDS: PALETTE["vermillion"], verdicts.FAILS: PALETTE["blue"]}


@styled
def defences_figure(summary: dict, path=None, title: str = ""):
    """What stops an on-policy attacker: per defence (one row each, ADS last), the defended attacker's
    student minus its control's in points with its 95 % interval (left; vermillion where the defence slows
    it by its interval), and what the defence costs honest users of the scores (right): KL(teacher ||
    served) in nats (log scale; none drawn where it sends no distribution) with the top-1 agreement."""
    rows = fd.defences(summary.get("points", []))
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(MAX_WIDTH_IN, 1.0 + 0.42 * max(1, len(rows))), sharey=True, width_ratios=(3, 2)
    )
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        colour = VERDICT_COLOURS.get(r["word"], PALETTE["grey"])
        if r["mean"] is None:
            continue
        xerr = None if not r["ci"] else [[(r["mean"] - r["ci"][0]) * 100], [(r["ci"][1] - r["mean"]) * 100]]
        left.errorbar(r["mean"] * 100, y, xerr=xerr, color=colour, marker="o", capsize=3, lw=1.4)
    left.axvline(0, color=BEFORE, ls=":", lw=1.2)
    left.set_yticks(ys, [f"{r['defence']}: {r['label']}" for r in rows])
    left.set_xlabel("attacker minus its control (points)")
    kl = [(y, r) for y, r in zip(ys, rows) if r["kl"]["mean"] is not None]
    floor = 1e-7
    right.barh(
        [y for y, _ in kl], [max(r["kl"]["mean"], floor) for _, r in kl], color=PALETTE["sky"], height=0.6
    )
    for y, r in kl:
        top1 = r["top1"]["mean"]
        right.annotate(
            f"top-1 {verdicts.pct(top1)}",
            (max(r["kl"]["mean"], floor), y),
            textcoords="offset points",
            xytext=(4, -3),
            fontsize=9,
        )
    for y, r in zip(ys, rows):
        if r["kl"]["mean"] is None:
            right.text(0.02, y, "no distribution sent", transform=right.get_yaxis_transform(), fontsize=9)
    right.set_xscale("log")
    right.set_xlabel("honest users' cost: KL(teacher ‖ served), nats")
    seeds = max((r["n"] for r in rows), default=0)
    seeds = f"{seeds} seed{'s' if seeds != 1 else ''}"
    fig.suptitle(title or f"what stops an on-policy attacker ({seeds}, 95 % intervals; left of 0: slowed)")
    fig.tight_layout()
    if path:
        fig.savefig(path, bbox_inches="tight")
    return fig


def correct_mark(ok: bool | None) -> str:
    """' ✓' for a right answer, ' ✗' for a wrong one, '' without a reference."""
    return "" if ok is None else (" ✓" if ok else " ✗")


@styled
def token_changes_figure(comparisons: Sequence[dict], path=None, title: str = "tokens ADS changed"):
    """A static picture of the token lens for headless runs: per comparison, the plain trace and the ADS
    trace with its changed tokens on orange."""
    rows = list(comparisons)
    fig, ax = plt.subplots(figsize=(MAX_WIDTH_IN, 0.8 * max(1, len(rows)) + 0.8))
    ax.axis("off")
    char = 0.62 * 9 / 72 / (MAX_WIDTH_IN * ax.get_position().width)  # a 9 pt monospace character
    text = dict(fontsize=9, family="monospace", va="center", transform=ax.transAxes)
    for i, c in enumerate(rows):
        y, dy = 1 - (i + 0.5) / max(1, len(rows)), 0.14 / max(1, len(rows))
        tag = {"ads-answer": "answer ", "ads-confident": "confident "}.get(c.get("method"), "")
        ax.text(0.0, y + dy, f"{prompt_label(c['prompt'], 12)} {tag}λ={c['lam']:g}", **text)
        ax.text(
            0.26,
            y + dy,
            f"plain: {c['plain_completion']}{correct_mark(c['plain_correct'])}",
            color="#555",
            **text,
        )
        ax.text(0.26, y - dy, "ADS:", **text)
        x = 0.26 + 5 * char
        for t in c["tokens"]:
            s = t["text"].replace("\n", "⏎")
            box = dict(boxstyle="square,pad=0.1", fc=PALETTE["orange"], ec="none") if t["changed"] else None
            ax.text(x, y - dy, s, bbox=box, **text)
            x += char * (max(1, len(s)) + 0.4)
            if x > 0.96:
                break
        ax.text(min(x + 0.01, 0.98), y - dy, correct_mark(c["correct"]).strip(), **text)
    ax.set_title(f"{title} (orange: a token plain sampling would not have drawn with the same noise)")
    fig.tight_layout()
    if path:
        fig.savefig(path)
    return fig
