"""What a finished antidistill run shows: the trade-off figures (`figures.py`), a table of every point, each
ADS point against the temperature sweep at the same teacher accuracy, in sentences built from summary.json;
what a run with several attackers shows (how far ADS moved each attacker's student, whether it slowed the
on-policy attacker against its control); and which tokens ADS changes, one prompt at a time (`TokenLens`).

    display(HTML(summary_table_html(summary))); tradeoff(run); print(explain(summary))
    print(attackers_explained(summary)); lens = TokenLens(run); c = lens.compare(0, lam=0.1, seed=0)
"""

from __future__ import annotations

from pathlib import Path

from opdkit import tasks
from opdkit.ads import sampler
from opdkit.data import prompts
from opdkit.jobs.antidistill import figures as tradeoff_figures
from opdkit.jobs.antidistill import sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.figures import attackers_in, tradeoff_curves
from opdkit.jobs.antidistill.points import result_key
from opdkit.models import eos_ids, load_tokenizer
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
    if attackers_in(summary) in ([], ["sft"]):
        return None
    return tradeoff_figures.attackers_figure(summary, path=run.figure("attackers"))


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
