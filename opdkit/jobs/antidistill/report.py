"""What a finished antidistill run shows: the trade-off figures, a table of every point, each ADS point
against the temperature sweep at the same teacher accuracy, in sentences built from summary.json.

    display(HTML(summary_table_html(summary))); tradeoff(run); print(explain(summary))
"""

from __future__ import annotations

from opdkit.jobs.antidistill import attack_report
from opdkit.jobs.antidistill import figures as tradeoff_figures
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.lens import TokenLens
from opdkit.run.folders import RunDir


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
            label = tradeoff_figures.ADS_LABELS.get(method, method)
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
        label = tradeoff_figures.ADS_LABELS.get(gp["method"], gp["method"])
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
                f"- {tradeoff_figures.ADS_LABELS.get(method, method)}: "
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
    return tradeoff_figures.tradeoff(run.read_summary(), path=run.figure("tradeoff"))


def tradeoff_loss(run: RunDir):
    """Teacher accuracy against the students' NLL on the gradient's held-out traces."""
    return tradeoff_figures.tradeoff_loss(run.read_summary(), path=run.figure("tradeoff_holdout_loss"))


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
    html = "".join(tradeoff_figures.token_changes_html(c) for c in comparisons)
    return html, tradeoff_figures.token_changes_figure(comparisons, path=run.figure("ads_tokens"))


def token_explorer(lens: TokenLens, cfg: AntidistillConfig):
    """A widget: any training prompt, λ (the sweep's, and twice the largest), gradient and seed
    (JupyterLab)."""
    methods = ["ads", "ads-answer"] if cfg.answer_lams else ["ads"]
    lams = sorted({0.0, *cfg.lams, *cfg.answer_lams, 2 * shown_lam(cfg)})
    return tradeoff_figures.ads_token_explorer(lens.compare, lens.labels, lams, methods)


def attackers(run: RunDir):
    """Teacher accuracy against each attacker's student accuracy (figures/attackers.png); None when only the
    SFT attacker ran."""
    summary = run.read_summary()
    if attack_report.attackers_in(summary) in ([], ["sft"]):
        return None
    return attack_report.attackers_figure(summary, path=run.figure("attackers"))


def attackers_explained(summary: dict) -> str:
    """What the attackers' students show, in sentences built from summary.json (`attack_report`)."""
    return attack_report.attackers_explained(summary)


def figures(run: RunDir) -> None:
    """Every figure of the run that needs no models, as a headless run keeps them."""
    tradeoff(run)
    tradeoff_loss(run)
    attackers(run)
