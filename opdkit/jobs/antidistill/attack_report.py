"""What a run with several attackers shows: teacher accuracy against each attacker's student accuracy (one
colour per attacker, ADS lines solid, temperature sampling dashed, the undistilled student as a line), a table
of every point, and a paragraph computed from summary.json: how far ADS moved each attacker's student, and
whether it slowed the on-policy attacker (opd, scored with the ADS distribution) against its control
(opd-plain, scored with the plain teacher).

    fig = attackers_figure(summary, path=run.figure("attackers")); print(attackers_explained(summary))
"""

from __future__ import annotations

from opdkit.jobs.antidistill.attackers import result_key
from opdkit.jobs.antidistill.config import ATTACKER_NAMES
from opdkit.jobs.antidistill.figures import tradeoff_curves
from opdkit.notebook.figures import plt

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


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _points(a: float, b: float) -> str:
    return f"{(b - a) * 100:+.1f} points"


def attackers_explained(summary: dict) -> str:
    """Sentences built from summary.json: per ADS line, each attacker's student at λ = 0 and at every λ, and
    the on-policy attacker against its plain-scored control at the same point."""
    found = attackers_in(summary)
    if found == ["sft"] or not found:
        return (
            "- only the SFT attacker ran (attackers: [sft]); add opd and opd-plain to measure on-policy ones."
        )
    lines = [f"- student before distillation: {_pct(summary.get('student_accuracy_before'))}."]
    for label, line in tradeoff_curves(summary).items():
        if label == "temperature":
            continue
        start = next((p for p in line if p["lam"] == 0), None)
        for p in (p for p in line if p["lam"] != 0):
            moved = []
            for a in found:
                now = p.get(result_key(a))
                was = start.get(result_key(a)) if start else None
                if now is None:
                    continue
                moved.append(
                    f"{a} {_pct(now)}" + (f" ({_points(was, now)} from λ = 0)" if was is not None else "")
                )
            teacher = f"teacher {_pct(p.get('teacher_accuracy'))}"
            if start and start.get("teacher_accuracy") is not None and p.get("teacher_accuracy") is not None:
                teacher += f" ({_points(start['teacher_accuracy'], p['teacher_accuracy'])})"
            lines.append(f"- {label}, λ={p['lam']:g}: {teacher}; students: " + ", ".join(moved) + ".")
    pairs = [
        (p, p[result_key("opd")] - p[result_key("opd-plain")])
        for p in summary["points"]
        if p["lam"] != 0
        and p.get(result_key("opd")) is not None
        and p.get(result_key("opd-plain")) is not None
    ]
    if pairs:
        slower = [p for p, d in pairs if d < 0]
        mean = sum(d for _, d in pairs) / len(pairs)
        lines.append(
            f"- the on-policy attacker scored with the ADS distribution ends {abs(mean) * 100:.1f} points "
            f"{'below' if mean < 0 else 'above'} its plain-scored control on average over {len(pairs)} ADS "
            f"point(s) ({len(slower)} below, {len(pairs) - len(slower)} not): "
            + (
                "serving the ADS distribution slowed the on-policy attacker in this run."
                if mean < 0
                else "serving the ADS distribution did not slow the on-policy attacker in this run."
            )
        )
        sft = [
            p[result_key("sft")] - p[result_key("opd")]
            for p, _ in pairs
            if p.get(result_key("sft")) is not None
        ]
        if sft:
            lines.append(
                f"- at the same ADS points the SFT student is {sum(sft) / len(sft) * 100:+.1f} points from "
                "the ADS-scored on-policy student on average (positive: SFT learns more from that teacher)."
            )
    runs = min((len(p.get("runs", [None])) for p in summary["points"]), default=0)
    lines.append(
        f"- each point is the mean of {runs} run(s); one run's accuracy moves by several points with the "
        "seeds alone, so differences of that size are not a finding."
    )
    return "\n".join(lines)
