"""What a finished antidistill run shows, from summary.json: its finding first (ADS against temperature
sampling at equal teacher accuracy, each verdict from its interval over seeds), a table of every point with
its intervals, the trade-off figures (`figures.py`), the ADS paper's crossing, each on-policy attacker
against its control; and which tokens ADS changes, one prompt at a time (`lens.TokenLens`, shown here as a
figure, HTML, and in JupyterLab a widget to explore them).

    display(HTML(summary_table_html(summary))); tradeoff(run); display(Markdown(explain(summary)))
    display(Markdown(attackers_explained(summary))); lens = TokenLens(run); c = lens.compare(0, lam=0.1)
    display(HTML(defences_table_html(summary))); defences(run); display(Markdown(defences_explained(summary)))
"""

from __future__ import annotations

import html as _html
from collections.abc import Sequence

from opdkit.jobs.antidistill import findings as fd
from opdkit.jobs.antidistill import sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.figures import (
    attackers_figure,
    attackers_in,
    correct_mark,
    defences_figure,
    token_changes_figure,
    tradeoff_figure,
    tradeoff_loss_figure,
)
from opdkit.jobs.antidistill.findings import ADS_LABELS
from opdkit.jobs.antidistill.lens import TokenLens
from opdkit.jobs.antidistill.points import result_key
from opdkit.notebook import verdicts
from opdkit.notebook.verdicts import pct, pct_interval, stat_text
from opdkit.notebook.widgets import live_view, reporting
from opdkit.run.folders import RunDir

__all__ = [
    "TokenLens",
    "attack_rows",
    "attackers",
    "attackers_explained",
    "attackers_figure",
    "attackers_in",
    "defences",
    "defences_explained",
    "defences_figure",
    "defences_table_html",
    "explain",
    "figures",
    "findings_of",
    "headline",
    "summary_table_html",
    "token_changes",
    "token_changes_figure",
    "token_changes_html",
    "token_explorer",
    "tradeoff",
    "tradeoff_figure",
    "tradeoff_loss",
    "tradeoff_loss_figure",
]


def findings_of(summary: dict) -> dict:
    """The run's findings: summary.json's, or computed now from its points (a run summarised before they
    were kept)."""
    if summary.get("findings"):
        return summary["findings"]
    return fd.findings({**summary, "points": [fd.with_intervals(p) for p in summary.get("points", [])]})


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
        f"{correct_mark(c['plain_correct'])}<br>"
        f'<span style="color:#666">ADS&nbsp;&nbsp;&nbsp;</span>{"".join(_token_span(t) for t in c["tokens"])}'
        f"{correct_mark(c['correct'])}</div>"
    )


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


def _cell(p: dict, key: str, n: int) -> str:
    return pct_interval(p.get(key), p.get(f"{key}_ci"), n) if p.get(key) is not None else "–"


def summary_table_html(summary: dict) -> str:
    """One row per point, each accuracy the mean over seeds with its interval; `slip` and `contradiction`
    split the teacher's wrong traces (tiny task: a wrong answer that follows from its own working, or one that
    contradicts it); `vs temperature` is the student minus the temperature sweep's at the point's teacher
    accuracy, seed by seed, with its verdict. `student (raw)` is the completions as written, `forced` with
    each final answer forced, as the ADS reference reports both."""
    summary = _with_intervals(summary)
    n = summary.get("repeats") or findings_of(summary).get("seeds", 1)
    gaps = {g["name"]: g for g in findings_of(summary).get("gaps", [])}
    cols = [
        "method",
        "λ",
        "τ",
        "teacher",
        "slip",
        "contradiction",
        "student (raw)",
        "forced",
        "vs temperature",
    ]
    cols += ["held-out NLL", "runs", "seconds"]
    rows = []
    for p in summary["points"]:
        err, loss, gap = p.get("errors") or {}, p.get("student_holdout_loss"), gaps.get(p["name"])
        versus = (
            "–" if gap is None or gap["mean"] is None else f"{stat_text(gap, signed=True)} ({gap['word']})"
        )
        cells = [
            p["method"],
            f"{p['lam']:g}",
            f"{p['temperature']:g}",
            _cell(p, "teacher_accuracy", n),
            pct(err.get("slip")),
            pct(err.get("contradiction")),
            _cell(p, "student_accuracy", n),
            _cell(p, "student_accuracy_forced", n),
            versus,
            "–" if loss is None else f"{loss:.3f}",
            str(len(p.get("runs", [1]))),
            f"{p['seconds']:.0f}",
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    caption = f"mean of {n} seeds [{verdicts.INTERVAL_NAME}]" if n > 1 else "one seed (no interval)"
    head = "".join(f"<th>{c}</th>" for c in cols)
    return f"<table><caption>{caption}</caption><tr>{head}</tr>{''.join(rows)}</table>"


def _error_lines(summary: dict) -> list[str]:
    """Per method, the range of the share of traces whose wrong answer contradicts their own working."""
    out = []
    for method in dict.fromkeys(p["method"] for p in summary["points"]):
        shares = [
            e["contradiction"] for p in summary["points"] if p["method"] == method and (e := p.get("errors"))
        ]
        if shares:
            out.append(
                f"- {ADS_LABELS.get(method, method)}: {pct(min(shares))} to {pct(max(shares))} of the traces "
                "have a wrong answer that contradicts their own working (the other wrong ones follow from a "
                "slip in it)."
            )
    return out


def headline(summary: dict) -> str:
    """The finding in one sentence: each ADS line against temperature sampling at the matched teacher
    accuracy, with its verdict."""
    m = findings_of(summary).get("matched") or {}
    ads = [line for line in m.get("lines", []) if "vs_temperature" in line]
    if not ads:
        return (
            "No ADS line shares a teacher accuracy with the temperature sweep in every seed, so this run "
            "cannot say whether ADS hurts distilled students more than temperature sampling."
        )
    parts = [
        f"{line['label']} leaves its students {stat_text(v, signed=True)} against temperature sampling's "
        f"(the claim that it hurts them more: **{v['word']}**)"
        for line in ads
        if (v := line["vs_temperature"])
    ]
    return f"At equal teacher accuracy ({pct(m['teacher_accuracy'])}), " + "; ".join(parts) + "."


def _crossing_lines(summary: dict) -> list[str]:
    out = []
    for c in findings_of(summary).get("crossings", []):
        if c["mean"] is None:
            out.append(
                f"- {c['label']}: its students stay above the undistilled student's accuracy down to the "
                f"teacher's {pct(c['lowest_teacher'])}, the lowest of its sweep: no crossing within it."
            )
            continue
        some = f" (in {c['reached']} of {c['seeds']} seeds; the others never get there)"
        out.append(
            f"- {c['label']}: the distilled student falls to the undistilled student's accuracy with the "
            f"teacher at {pct_interval(c['mean'], c['ci'], c['reached'])}"
            f"{'' if c['reached'] == c['seeds'] else some}."
        )
    return out


def _gradient_line(summary: dict) -> list[str]:
    """Which of the proxy's gradients the ADS line steers by, when not the whole completion's."""
    tokens = summary.get("grad_tokens", "all")
    if tokens == "confident":
        return [
            "- ADS steers by the proxy's gradient without the teacher's hesitations (grad_tokens confident: "
            f"completion tokens outside the answer with teacher entropy above {summary['grad_entropy']:g} "
            "nats left out)."
        ]
    if tokens == "answer":
        return ["- ADS steers by the proxy's gradient on the final answer's tokens (grad_tokens answer)."]
    return []


def _crossing_gap_lines(summary: dict) -> list[str]:
    """Each ADS line's crossing against temperature's, paired by seed, or which line did not cross."""
    out = []
    for g in findings_of(summary).get("crossing_gaps", []):
        if g["missing"]:
            short = "; ".join(
                f"{m['label']} crossed in {m['reached']} of {m['seeds']} seeds" for m in g["missing"]
            )
            out.append(
                f"- {g['claim']}: not computed, it needs both lines to cross in every seed ({short}); "
                "a sweep reaching lower teacher accuracies (larger λ, τ) would give it."
            )
            continue
        reversed_ = " (reversed: temperature's crossing lies above)" if g["word"] == verdicts.FAILS else ""
        out.append(f"- {verdicts.sentence(g).removesuffix('.')}{reversed_}.")
    return out


def explain(summary: dict) -> str:
    """What this run concludes, in sentences computed from summary.json: the headline finding with its
    verdict, the ADS paper's crossing per line, each ADS point against temperature sampling, the traces'
    errors, and the students' held-out NLL."""
    f = findings_of(summary)
    n = f.get("seeds", 0)
    lines = [f"**Finding.** {headline(summary)}"]
    lines += _gradient_line(summary)
    for p in summary.get("failed_points", []):
        last = p["error"].strip().splitlines()[-1] if p["error"].strip() else "?"
        lines.append(
            f"- **{p['name']} failed** ({last}); its traceback is in points/{p['name']}/error.txt, and "
            "`resume=True` with the same run_dir runs it again."
        )
    m = f.get("matched") or {}
    for line in m.get("lines", []):
        lines.append(
            f"- at teacher {pct(m['teacher_accuracy'])}: {line['label']} students {stat_text(line)}."
        )
    lines.append(
        "- the ADS paper's measure, the teacher accuracy at which a line's distilled student falls to the "
        f"undistilled student's {pct(summary.get('student_accuracy_before'))} (raw):"
    )
    lines += ["  " + c for c in _crossing_lines(summary)]
    lines += ["  " + c for c in _crossing_gap_lines(summary)]
    for g in f.get("gaps", []):
        if g["mean"] is None:
            where = g["claim"].split(" leaves")[0]
            lines.append(f"- {where}: outside the temperature sweep's teacher accuracies, no comparison.")
        else:
            lines.append(f"- {verdicts.sentence(g)}")
    lines += _error_lines(summary)
    lines += _nll_line(summary)
    if n < 3:
        lines.append(
            f"- {n} seed{'s' if n != 1 else ''}: one run's student accuracy moves by several points with the "
            "sampling noise and the SFT order alone; `-p mode tiny-seeds` (or `-p repeats 3`) gives every "
            "point its interval."
        )
    return "\n".join(lines)


def _nll_line(summary: dict) -> list[str]:
    """The students' NLL on the gradient's held-out traces, highest under ADS against highest under
    temperature: what ADS steers, whatever it did to accuracy."""
    key = "student_holdout_loss"
    highest = {
        label: max(
            (p[key] for p in line if p.get(key) is not None and (label == "temperature" or p["lam"])),
            default=None,
        )
        for label, line in fd.lines(summary["points"]).items()
    }
    temp = highest.pop("temperature", None)
    ads = ", ".join(f"{label} up to {v:.3f}" for label, v in highest.items() if v is not None)
    if temp is None or not ads:
        return []
    before = summary.get("student_holdout_loss_before")
    return [
        "- the students' NLL on the gradient's held-out traces (what ADS steers by), in nats per token: "
        f"under {ads}; under temperature sampling up to {temp:.3f}"
        + (f"; before distillation {before:.3f}" if before is not None else "")
        + ". ADS moves the students where its gradient points; accuracy says whether that is what the "
        "evaluation rewards."
    ]


def attack_rows(summary: dict) -> list[dict]:
    """One row per point: λ, τ, the teacher's accuracy and each attacker's student accuracy (means)."""
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


def _attacker_state(r: dict, before: float | None) -> str:
    if r["damaged"]:
        return f"**damaged**: it ends below where it started ({pct(before)}) by its whole interval"
    return "slowed, not damaged" if r["word"] == verdicts.HOLDS else "not slowed beyond the noise"


def attackers_explained(summary: dict) -> str:
    """Each on-policy attacker's finding from summary.json: per ADS point, the ADS-scored student against its
    control (shared by every λ of its τ), with its verdict, and "damaged" where it ends below its start."""
    found = attackers_in(summary)
    if found == ["sft"] or not found:
        return (
            "- only the SFT attacker ran (attackers: [sft]); add opd and opd-plain to measure on-policy ones."
        )
    before = summary.get("student_accuracy_before")
    rows = findings_of(summary).get("attackers", [])
    lines = []
    if rows:
        held = sum(r["word"] == verdicts.HOLDS for r in rows)
        each = "; ".join(f"λ={r['lam']:g}: {stat_text(r, signed=True)}, **{r['word']}**" for r in rows)
        lines.append(
            "**Finding.** Serving the ADS distribution slows the on-policy attacker against its control at "
            f"{held} of {len(rows)} ADS point(s) by its interval ({each})."
        )
    lines.append(
        "- the control (opd-plain) is one on-policy student per temperature and seed, trained once and "
        "shared by every λ of that temperature; at λ = 0 the ADS-scored student is that control (the same "
        f"teacher), so λ = 0 is no comparison. Student before distillation: {pct(before)}."
    )
    for r in rows:
        lines.append(
            f"- λ={r['lam']:g} (τ={r['temperature']:g}): ADS-scored student {stat_text(r['student'])}, "
            f"control {stat_text(r['control'])}; {_attacker_state(r, before)}."
        )
    sft, opd = result_key("sft"), result_key("opd")
    diffs = [
        p[sft] - p[opd]
        for p in summary["points"]
        if p["lam"] and p.get(opd) is not None and p.get(sft) is not None
    ]
    if diffs:
        lines.append(
            f"- at the same ADS points the SFT student is {verdicts.points(sum(diffs) / len(diffs))} from "
            "the ADS-scored on-policy student on average (positive: SFT learns more from that teacher)."
        )
    return "\n".join(lines)


def _with_intervals(summary: dict) -> dict:
    """A summary whose points carry their intervals (a run summarised before they were kept gets them now)."""
    return {**summary, "points": [fd.with_intervals(p) for p in summary.get("points", [])]}


def tradeoff(run: RunDir):
    """Teacher accuracy (x) against the distilled students' held-out accuracy (y), one curve per sweep."""
    return tradeoff_figure(_with_intervals(run.read_summary()), path=run.figure("tradeoff"))


def tradeoff_loss(run: RunDir):
    """Teacher accuracy against the students' NLL on the gradient's held-out traces."""
    return tradeoff_loss_figure(_with_intervals(run.read_summary()), path=run.figure("tradeoff_holdout_loss"))


def shown_lam(cfg: AntidistillConfig, method: str = "ads") -> float:
    """The λ the token views show by default: the sweep's largest (0.1 when the sweep has none)."""
    lams = getattr(cfg, sweep.SWEEPS[method])
    return max(lams) if lams else 0.1


def swept_methods(cfg: AntidistillConfig) -> list[str]:
    """The ADS methods the token views show: the completion gradient's always, the others when swept."""
    return ["ads"] + [m for m, name in sweep.SWEEPS.items() if m != "ads" and getattr(cfg, name)]


def token_changes(run: RunDir, lens: TokenLens, cfg: AntidistillConfig, prompts: int = 3):
    """The tokens ADS changed on the first `prompts` training prompts at the largest λ of each sweep (the
    completion gradient's, and the others' when swept): (HTML, static figure)."""
    comparisons = [
        lens.compare(i, shown_lam(cfg, m), seed=0, method=m)
        for m in swept_methods(cfg)
        for i in range(prompts)
    ]
    html = "".join(token_changes_html(c) for c in comparisons)
    return html, token_changes_figure(comparisons, path=run.figure("ads_tokens"))


def token_explorer(lens: TokenLens, cfg: AntidistillConfig):
    """A widget where a person is watching (JupyterLab): any training prompt, λ (the sweep's, and twice the
    largest), gradient and seed; a headless run says where to find it instead."""
    methods = swept_methods(cfg)
    lams = sorted({0.0, *(lam for m in methods for lam in getattr(cfg, sweep.SWEEPS[m])), 2 * shown_lam(cfg)})
    return live_view(
        lambda: ads_token_explorer(lens.compare, lens.labels, lams, methods),
        "<i>The token explorer computes as you pick, so it needs a running kernel: open this notebook in "
        "JupyterLab and run it there. The static figure above is this run's.</i>",
    )


def attackers(run: RunDir):
    """Teacher accuracy against each attacker's student accuracy (figures/attackers.png); None when only the
    SFT attacker ran."""
    summary = _with_intervals(run.read_summary())
    if attackers_in(summary) in ([], ["sft"]):
        return None
    return attackers_figure(summary, path=run.figure("attackers"))


def figures(run: RunDir) -> None:
    """Every figure of the run that needs no models, as a headless run keeps them."""
    tradeoff(run)
    tradeoff_loss(run)
    attackers(run)
    defences(run)


def defences(run: RunDir):
    """What stops an on-policy attacker (figures/defences.png); None when the run had no `defences`."""
    summary = _with_intervals(run.read_summary())
    if not findings_of(summary).get("defences"):
        return None
    return defences_figure(summary, path=run.figure("defences"))


def _cost_cells(r: dict) -> list[str]:
    kl, top1 = r["kl"]["mean"], r["top1"]["mean"]
    return ["–" if kl is None else f"{kl:.2g}", "–" if top1 is None else pct(top1)]


def defences_table_html(summary: dict) -> str:
    """One row per defence of the teacher's scores (ADS last, the reference): what the API returns, the
    defended attacker's student, its difference from the control (opd-plain at τ 1, paired by seed) with
    its interval and verdict (the claim: the defence slows the attacker), and the cost to honest users of
    the scores: KL(teacher || served) in nats, the top-1 agreement (– where no distribution is sent), and
    the teacher's accuracy (unchanged by a score-only defence; ADS's own at its λ)."""
    rows = findings_of(summary).get("defences", [])
    if not rows:
        return (
            "<p>No defences in this run (<code>defences: []</code>; <code>-p mode tiny-defences</code>).</p>"
        )
    n = max(r["n"] for r in rows)
    cols = ["defence", "the API returns", "attacker's student", "minus control", "verdict"]
    cols += ["KL(teacher ‖ served), nats", "top-1 agreement", "teacher accuracy"]
    control = rows[0]["control"]
    body = [
        "<tr><td>none (control)</td><td>every log-prob</td>"
        f"<td>{stat_text(control)}</td><td>–</td><td>–</td><td>0</td><td>100.0 %</td>"
        f"<td>{stat_text(rows[0]['teacher_accuracy'])}</td></tr>"
    ]
    for r in rows:
        wide = " (wider than ±10 points: 10 seeds)" if r["wide"] else ""
        cells = [
            r["defence"],
            r["label"],
            stat_text(r["student"]),
            stat_text(r, signed=True),
            f"{r['word']}{', damaged' if r.get('damaged') else ''}{wide}",
            *_cost_cells(r),
            stat_text(r["teacher_accuracy"]),
        ]
        body.append("<tr>" + "".join(f"<td>{_html.escape(c)}</td>" for c in cells) + "</tr>")
    caption = f"what stops an on-policy attacker: mean of {n} seeds [{verdicts.INTERVAL_NAME}]"
    head = "".join(f"<th>{c}</th>" for c in cols)
    return f"<table><caption>{caption}</caption><tr>{head}</tr>{''.join(body)}</table>"


def _cost_text(r: dict) -> str:
    if r["kl"]["mean"] is None:
        return "it sends honest users no distribution to read (one token's log-prob)"
    return f"it costs honest users KL {r['kl']['mean']:.2g} nats and top-1 agreement {pct(r['top1']['mean'])}"


def _answers_text(r: dict) -> str:
    """ADS's own cost: the accuracy of what the teacher answers at its λ (a score-only defence: none)."""
    return (
        f", the teacher answering at {stat_text(r['teacher_accuracy'])}"
        if r["defence"].startswith("ads")
        else ""
    )


def defences_explained(summary: dict) -> str:
    """A finding sentence per defence (its verdict against the control, and its cost), then the closing
    paragraph: what stops an on-policy attacker in this run, and what it costs."""
    rows = findings_of(summary).get("defences", [])
    if not rows:
        return "- no defences ran (`defences: []`); `-p mode tiny-defences` runs them."
    before = summary.get("student_accuracy_before")
    lines = []
    for r in rows:
        teacher = (
            f"; the teacher answers at {stat_text(r['teacher_accuracy'])}"
            if r["defence"].startswith("ads")
            else ""
        )
        damaged = (
            f"; **damaged**: its student ends below where it started ({pct(before)}) by its whole interval"
            if r.get("damaged")
            else ""
        )
        lines.append(f"- {verdicts.sentence(r).removesuffix('.')}{damaged}; {_cost_text(r)}{teacher}.")
    lines.append("")
    lines.append(f"**What stops an on-policy attacker here.** {closing(rows)}")
    return "\n".join(lines)


def closing(rows: list[dict]) -> str:
    """One paragraph from the defences' rows: which slow the attacker by their interval and at what cost to
    honest users (and which of them damage it), which do not beyond the noise, and what a score-only
    defence leaves of the teacher."""
    n = max(r["n"] for r in rows)
    seeds = f"{n} seed{'s' if n != 1 else ''}"
    slow = [r for r in rows if r["word"] == verdicts.HOLDS]
    other = [r for r in rows if r["word"] != verdicts.HOLDS]
    each = lambda group: "; ".join(f"{r['defence']} {stat_text(r, signed=True)}" for r in group)  # noqa: E731
    if slow:
        costs = "; ".join(
            f"{r['defence']}: {_cost_text(r).removeprefix('it ')}{_answers_text(r)}" for r in slow
        )
        damaged = [r["defence"] for r in slow if r.get("damaged")]
        broken = (
            f" {', '.join(damaged)} more than slow{'s' if len(damaged) == 1 else ''} it: the student ends "
            "below where it started, the attacker's loss failing at its learning rate."
            if damaged
            else ""
        )
        head = (
            f"At {seeds}, {len(slow)} of {len(rows)} defences slow the attacker against its control by "
            f"their interval ({each(slow)}), at this cost ({costs}).{broken}"
        )
    else:
        head = f"At {seeds}, no defence slows the attacker against its control by its interval."
    rest = f" The others stay within the noise or do not slow it ({each(other)})." if other else ""
    wide = [r["defence"] for r in rows if r["wide"]]
    if wide:
        rest += f" Wider than ±10 points at {seeds}, so 10 seeds would settle them: {', '.join(wide)}."
    teacher = rows[0]["teacher_accuracy"]
    tail = (
        f" Score-only defences leave the teacher's own answers as they are ({stat_text(teacher)}); ADS "
        "changes them (its row's teacher accuracy)."
    )
    return head + rest + tail
