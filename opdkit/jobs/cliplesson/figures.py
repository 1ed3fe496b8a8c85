"""The clip lesson's own figures: every arm's loss and pre-clip gradient norm, and the accuracy each arm
ends at.

fig = lesson_curves(arm_records, thresholds, path=lesson.figure("loss_and_grad_norm"))
"""

from __future__ import annotations

import math

from opdkit.notebook import figures
from opdkit.notebook.figures import plt

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
        ax_l.plot(*figures.series(records, "loss"), lw=1.2, label=name, color=colour)
        ax_g.plot(*figures.series(records, "grad_norm"), lw=1.0, label=name, color=colour)
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
