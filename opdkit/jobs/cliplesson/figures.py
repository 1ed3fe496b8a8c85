"""The clip lesson's own figures: every arm's loss and pre-clip gradient norm, and the accuracy each arm
ends at, arm against arm (each arm one colour of the kit's palette, unclipped arms dashed).

fig = lesson_curves(records_by_arm, thresholds, path=lesson.figure("loss_and_grad_norm"))
"""

from __future__ import annotations

import math

from opdkit.notebook import figures, verdicts
from opdkit.notebook.figures import MAX_WIDTH_IN, PALETTE, plt, styled

ARM_COLOURS = {
    "clip": PALETTE["blue"],
    "noclip": PALETTE["vermillion"],
    "clip-at-noclip-lr": PALETTE["orange"],
    "noclip-at-clip-lr": PALETTE["sky"],
    "sgd-clip": PALETTE["green"],
    "sgd-noclip": PALETTE["purple"],
}


def arm_style(name: str, clipping: bool) -> dict:
    return {"color": ARM_COLOURS.get(name, PALETTE["black"]), "ls": "-" if clipping else "--"}


@styled
def lesson_curves(
    records: dict[str, list[list[dict]]], thresholds: dict[str, float], clipping: dict[str, bool], path=None
):
    """Loss per step and pre-clip gradient norm (log scale, each clipped arm's threshold dotted), one line
    per arm: its seeds' mean, with their 95 % band when there are several."""
    fig, (ax_l, ax_g) = plt.subplots(1, 2, figsize=(MAX_WIDTH_IN, 4.4))
    for name, runs in records.items():
        style = arm_style(name, clipping.get(name, True))
        for ax, key in ((ax_l, "loss"), (ax_g, "grad_norm")):
            if len(runs) > 1:
                x, mean, low, high = figures.band_series(runs, key)
                ax.plot(x, mean, lw=1.3, label=name, **style)
                ax.fill_between(x, low, high, color=style["color"], alpha=0.18, lw=0)
            else:
                ax.plot(*figures.series(runs[0], key), lw=1.2, label=name, **style)
        thr = thresholds.get(name)
        if thr and math.isfinite(thr) and thr < 1e8:
            ax_g.axhline(thr, color=style["color"], ls=":", lw=1)
    n = max((len(r) for r in records.values()), default=1)
    ax_l.set_title("divergence per token (reverse KL)")
    ax_l.set_ylabel("nats / token")
    ax_g.set_title("pre-clip gradient norm; dotted: clip threshold")
    ax_g.set_ylabel("L2 norm (log scale)")
    ax_g.set_yscale("log")
    for ax in (ax_l, ax_g):
        ax.set_xlabel("optimizer step")
    handles, labels = ax_l.get_legend_handles_labels()
    seeds = f"; mean of {n} seeds, band: 95 % interval" if n > 1 else ""
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), frameon=False)
    fig.suptitle(f"every arm, solid clipped, dashed unclipped{seeds}")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    if path:
        fig.savefig(path)
    return fig


@styled
def lesson_accuracy(arms: dict[str, dict], path=None):
    """Final accuracy per arm: the bar at the seeds' mean, the error bar its 95 % interval, a dot per seed;
    the dotted line is the student before training."""
    names = list(arms)
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, 1.6 * len(names) + 2.2), 4.0))
    for i, name in enumerate(names):
        entry = arms[name]
        mean, ci = entry.get("final_accuracy") or 0.0, entry.get("final_accuracy_ci")
        style = arm_style(name, entry.get("clipping", True))
        ax.bar(i, mean, color=style["color"], alpha=0.85, hatch="" if entry.get("clipping", True) else "//")
        if ci:
            ax.errorbar(i, mean, yerr=[[mean - ci[0]], [ci[1] - mean]], color="black", capsize=4, lw=1)
        accs = [s.get("final_accuracy") for s in entry.get("seeds", {}).values()]
        accs = [a for a in accs if a is not None]
        if len(accs) > 1:
            ax.scatter([i] * len(accs), accs, color="black", s=14, zorder=3)
        ax.text(i, (ci[1] if ci else mean) + 0.03, verdicts.pct(mean, 0), ha="center", fontsize=9)
    labels = [
        f"{n}\n{arms[n].get('optimizer', 'adamw')} lr {arms[n]['learning_rate']:g}\n"
        f"{'clip' if arms[n]['clipping'] else 'no clip'}"
        for n in names
    ]
    ax.set_xticks(range(len(names)), labels, fontsize=9)
    before = next(
        (e.get("accuracy_before") for e in arms.values() if e.get("accuracy_before") is not None), None
    )
    if before is not None:
        ax.axhline(
            before, color=figures.BEFORE, ls=":", lw=1.2, label=f"student before ({verdicts.pct(before)})"
        )
        ax.legend(loc="upper right")
    figures.percent_axis(ax, top=1.05)
    ax.set_ylabel("held-out accuracy after training")
    n = max((len(e.get("seeds", {})) for e in arms.values()), default=1)
    ax.set_title(f"mean of {n} seeds, 95 % interval" if n > 1 else "one seed (no interval)")
    fig.tight_layout()
    if path:
        fig.savefig(path, bbox_inches="tight")
    return fig
