"""What a finished antidistill run shows: the trade-off of teacher against distilled-student accuracy
(figures, each also saved where `path` says), a table of every point, each ADS point against the temperature
sweep at the same teacher accuracy in sentences built from summary.json; what a run with several attackers
shows (how far ADS moved each attacker's student, whether it slowed the on-policy attacker against its
control); and which tokens ADS changes, one prompt at a time (`TokenLens`: a figure, HTML, and a widget to
explore them).

    display(HTML(summary_table_html(summary))); tradeoff(run); print(explain(summary))
    print(attackers_explained(summary)); lens = TokenLens(run); c = lens.compare(0, lam=0.1, seed=0)
"""

from __future__ import annotations

import html as _html
from collections.abc import Sequence
from pathlib import Path

from opdkit import tasks
from opdkit.ads import sampler
from opdkit.data import prompts
from opdkit.jobs.antidistill import sweep
from opdkit.jobs.antidistill.config import ATTACKER_NAMES, AntidistillConfig
from opdkit.jobs.antidistill.points import result_key
from opdkit.models import eos_ids, load_tokenizer
from opdkit.notebook.figures import plt, prompt_label
from opdkit.notebook.widgets import reporting
from opdkit.run.folders import RunDir

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


def tradeoff_figure(summary: dict, path=None, title: str = ""):
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


def tradeoff_loss_figure(summary: dict, path=None):
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


def temperature_student_at(points: list[dict], teacher_accuracy: float) -> float | None:
    """The temperature sweep's student accuracy at this teacher accuracy, linearly interpolated between its
    two nearest points (by teacher accuracy); None outside the sweep's range or with fewer than 2 points."""
    curve = sorted(
        (p["teacher_accuracy"], p["student_accuracy"])
        for p in points
        if p["lam"] == 0 and p["teacher_accuracy"] is not None
    )
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= teacher_accuracy <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (teacher_accuracy - x0) / (x1 - x0)
    return None


def gaps(summary: dict) -> list[dict]:
    """Per ADS point: its student accuracy minus the temperature sweep's at the same teacher accuracy.
    Negative: ADS hurt the distilled student more than temperature sampling did, at equal teacher accuracy."""
    out = []
    for p in summary["points"]:
        if p["lam"] == 0 or p["teacher_accuracy"] is None:
            continue
        ref = temperature_student_at(summary["points"], p["teacher_accuracy"])
        out.append(
            {
                "name": p["name"],
                "method": p["method"],
                "lam": p["lam"],
                "temperature": p["temperature"],
                "teacher_accuracy": p["teacher_accuracy"],
                "student_accuracy": p["student_accuracy"],
                "temperature_student_accuracy": ref,
                "gap": None if ref is None else p["student_accuracy"] - ref,
            }
        )
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1%}"


def summary_table_html(summary: dict) -> str:
    """One row per point; `slip` and `contradiction` split the teacher's wrong traces (tiny task): a wrong
    answer that follows from its own working, or one that contradicts it. `student_accuracy` is raw (the
    completions as written), `student_accuracy_forced` with each final answer forced, as the ADS reference
    reports both."""
    cols = [
        "method",
        "lam",
        "temperature",
        "teacher_accuracy",
        "slip",
        "contradiction",
        "student_accuracy",
        "student_accuracy_forced",
        "student_holdout_loss",
        "runs",
        "seconds",
    ]
    head = "".join(f"<th>{c}</th>" for c in cols)
    rows = []
    for p in summary["points"]:
        err, loss = p.get("errors") or {}, p.get("student_holdout_loss")
        cells = [
            p["method"],
            f"{p['lam']:g}",
            f"{p['temperature']:g}",
            _pct(p["teacher_accuracy"]),
            _pct(err.get("slip")),
            _pct(err.get("contradiction")),
            _pct(p["student_accuracy"]),
            _pct(p.get("student_accuracy_forced")),
            "–" if loss is None else f"{loss:.3f}",
            str(len(p.get("runs", [1]))),
            f"{p['seconds']:.0f}",
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _error_lines(summary: dict) -> list[str]:
    """Per method, the range of the share of traces whose wrong answer contradicts their own working."""
    out = []
    for method in dict.fromkeys(p["method"] for p in summary["points"]):
        shares = [
            p["errors"]["contradiction"]
            for p in summary["points"]
            if p["method"] == method and p.get("errors")
        ]
        if shares:
            label = ADS_LABELS.get(method, method)
            out.append(
                f"- {label}: {min(shares):.1%} to {max(shares):.1%} of the traces have a wrong answer that "
                "contradicts their own working (the rest of the wrong ones follow from a slip in it)."
            )
    return out


def explain(summary: dict) -> str:
    """What this run measured, in sentences built from summary.json: each ADS point against the temperature
    sweep at the same teacher accuracy."""
    lines = [
        f"- student before distillation: {_pct(summary.get('student_accuracy_before'))} raw, "
        f"{_pct(summary.get('student_accuracy_before_forced'))} with its final answer forced; the "
        "comparisons below are of raw accuracy, the forced one is in the table and the figure's right panel."
    ]
    for p in summary.get("failed_points", []):
        last = p["error"].strip().splitlines()[-1] if p["error"].strip() else "?"
        lines.append(
            f"- **{p['name']} failed** ({last}); its traceback is in points/{p['name']}/error.txt, and "
            "`resume=True` with the same run_dir runs it again."
        )
    for gp in gaps(summary):
        label = ADS_LABELS.get(gp["method"], gp["method"])
        where = (
            f"{label} λ={gp['lam']:g} (τ={gp['temperature']:g}): teacher {_pct(gp['teacher_accuracy'])}, "
            f"student {_pct(gp['student_accuracy'])}"
        )
        if gp["gap"] is None:
            lines.append(
                f"- {where}; outside the temperature sweep's range of teacher accuracy, no comparison."
            )
        else:
            verdict = "lower" if gp["gap"] < 0 else "higher"
            lines.append(
                f"- {where}; temperature sampling at that teacher accuracy: student "
                f"{_pct(gp['temperature_student_accuracy'])}, so the ADS student is "
                f"{abs(gp['gap']) * 100:.1f} points {verdict}."
            )
    lines += _error_lines(summary)
    runs = min((len(p.get("runs", [None])) for p in summary["points"]), default=0)
    for method in dict.fromkeys(gp["method"] for gp in gaps(summary)):
        known = [gp["gap"] for gp in gaps(summary) if gp["method"] == method and gp["gap"] is not None]
        if known:
            lines.append(
                f"- {ADS_LABELS.get(method, method)}: "
                f"mean gap {sum(known) / len(known) * 100:+.1f} points "
                f"over {len(known)} comparable point(s) (negative favours ADS)."
            )
    lines.append(
        f"- each point is the mean of {runs} run(s); one run's student accuracy moves by several points with "
        "the sampling noise and the SFT order alone (raise `repeats` to average it)."
    )
    return "\n".join(lines)


def tradeoff(run: RunDir):
    """Teacher accuracy (x) against the distilled students' held-out accuracy (y), one curve per sweep."""
    return tradeoff_figure(run.read_summary(), path=run.figure("tradeoff"))


def tradeoff_loss(run: RunDir):
    """Teacher accuracy against the students' NLL on the gradient's held-out traces."""
    return tradeoff_loss_figure(run.read_summary(), path=run.figure("tradeoff_holdout_loss"))


def shown_lam(cfg: AntidistillConfig, method: str = "ads") -> float:
    """The λ the token views show by default: the sweep's largest (0.1 when the sweep has none)."""
    lams = cfg.lams if method == "ads" else cfg.answer_lams
    return max(lams) if lams else 0.1


def token_changes(run: RunDir, lens: TokenLens, cfg: AntidistillConfig, prompts: int = 3):
    """The tokens ADS changed on the first `prompts` training prompts at the largest λ of each sweep (the
    completion gradient's, and the answer gradient's when swept): (HTML, static figure)."""
    comparisons = [lens.compare(i, shown_lam(cfg), seed=0) for i in range(prompts)]
    if cfg.answer_lams:
        lam = shown_lam(cfg, "ads-answer")
        comparisons += [lens.compare(i, lam, seed=0, method="ads-answer") for i in range(prompts)]
    html = "".join(token_changes_html(c) for c in comparisons)
    return html, token_changes_figure(comparisons, path=run.figure("ads_tokens"))


def token_explorer(lens: TokenLens, cfg: AntidistillConfig):
    """A widget: any training prompt, λ (the sweep's, and twice the largest), gradient and seed
    (JupyterLab)."""
    methods = ["ads", "ads-answer"] if cfg.answer_lams else ["ads"]
    lams = sorted({0.0, *cfg.lams, *cfg.answer_lams, 2 * shown_lam(cfg)})
    return ads_token_explorer(lens.compare, lens.labels, lams, methods)


def attackers(run: RunDir):
    """Teacher accuracy against each attacker's student accuracy (figures/attackers.png); None when only the
    SFT attacker ran."""
    summary = run.read_summary()
    if attackers_in(summary) in ([], ["sft"]):
        return None
    return attackers_figure(summary, path=run.figure("attackers"))


def figures(run: RunDir) -> None:
    """Every figure of the run that needs no models, as a headless run keeps them."""
    tradeoff(run)
    tradeoff_loss(run)
    attackers(run)


def _pct_or_na(v: float | None) -> str:
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
    lines = [f"- student before distillation: {_pct_or_na(summary.get('student_accuracy_before'))}."]
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
                    f"{a} {_pct_or_na(now)}"
                    + (f" ({_points(was, now)} from λ = 0)" if was is not None else "")
                )
            teacher = f"teacher {_pct_or_na(p.get('teacher_accuracy'))}"
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


class TokenLens:
    """Which tokens ADS changes, one training prompt at a time, with a finished run's teacher and gradient.

        lens = TokenLens(run)
        c = lens.compare(0, lam=0.1, seed=0)   # {"tokens": [{"text", "plain_text", "changed", ...}], ...}

    ADS and plain sampling share their random noise at every step (`sampler.coupled_sample`), so a token is
    marked changed exactly where the ADS term moved the draw; the trace goes on with the ADS token.
    """

    def __init__(self, run: RunDir | str | Path, num_prompts: int = 8):
        self.cfg, _ = sweep.load_run_config(run)
        cfg, self.device = self.cfg, sweep.device()
        self.tokenizer = load_tokenizer(cfg.teacher_model)
        self.task = tasks.for_dataset(cfg.dataset_path)
        messages, answers = sweep.training_prompts(cfg, self.task)
        self.messages, self.answers = messages[:num_prompts], answers[:num_prompts]
        run = RunDir.attach(cfg.run_dir)
        proxy_tok = load_tokenizer(cfg.proxy_model)
        student_tok = load_tokenizer(cfg.student_tokenizer or cfg.student_model)
        self.steering, _ = sweep.load_steering(
            cfg, proxy_tok, student_tok, sweep.grads_path(cfg, run), self.device, run
        )

    @property
    def labels(self) -> list[str]:
        return [m[-1]["content"][:60] for m in self.messages]

    def _trace(self, index: int, lam: float, seed: int, method: str) -> list[dict]:
        cfg = self.cfg
        ids = prompts.prompt_ids(self.tokenizer, self.messages[index], cfg.enable_thinking)
        tau = cfg.ads_temperatures[0] if cfg.ads_temperatures else 1.0
        direction = self.steering.direction(sweep.GRADIENTS[method]) if lam else None
        return sampler.coupled_sample(
            self.steering.teacher,
            direction,
            ids,
            lam=lam,
            temperature=tau,
            top_p=cfg.trace_top_p,
            top_k=cfg.trace_top_k,
            eos_token_id=eos_ids(self.tokenizer, self.steering.teacher),
            max_new_tokens=cfg.max_new_tokens,
            seed=seed,
        )

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def compare(self, index: int, lam: float, seed: int = 0, method: str = "ads") -> dict:
        """The ADS trace at λ with its changed tokens, and the plain trace drawn with the same noise; `method`
        "ads-answer" steers by the answer-token gradient."""
        if method not in sweep.GRADIENTS:
            raise ValueError(f"method={method!r} is not one of {sorted(sweep.GRADIENTS)}.")
        steps, plain = self._trace(index, lam, seed, method), self._trace(index, 0.0, seed, method)
        tokens = [
            {
                "text": self._text(s["token"]),
                "plain_text": self._text(s["plain_token"]),
                "changed": s["token"] != s["plain_token"],
                "p_ads": s["p_ads"],
                "p_plain": s["p_plain"],
                "p_plain_choice": s["p_plain_choice"],
            }
            for s in steps
        ]
        check, answer = self.task.check, self.answers[index]
        text = self.tokenizer.decode([s["token"] for s in steps], skip_special_tokens=True)
        plain_text = self.tokenizer.decode([s["token"] for s in plain], skip_special_tokens=True)
        return {
            "prompt": self.labels[index],
            "answer": answer,
            "lam": lam,
            "seed": seed,
            "method": method,
            "temperature": self.cfg.ads_temperatures[0] if self.cfg.ads_temperatures else 1.0,
            "tokens": tokens,
            "completion": text,
            "plain_completion": plain_text,
            "correct": check(text, answer) if answer else None,
            "plain_correct": check(plain_text, answer) if answer else None,
        }
