"""What an antidistill run concludes, computed from its points' runs (one per seed): the lines of the
trade-off, each point's statistics over seeds, ADS against temperature sampling at equal teacher accuracy,
the ADS paper's crossing, and each on-policy attacker against its control; every claim a verdict from its
95 % interval over seeds (`notebook.verdicts`).

    summary["points"] = [with_intervals(p) for p in summary["points"]]
    summary["findings"] = findings(summary)   # matched, gaps, crossings, crossing_gaps, attackers

Paired by seed: the points of one repeat share their seed (the same sampling noise, SFT order and student),
so each comparison is made seed by seed (an ADS point against the temperature curve of the same seed, an
attacker against its control of the same seed) and the interval is that of the per-seed differences.

- **matched**: one teacher accuracy every line reaches in every seed (the highest of their lowest); each
  line's student accuracy interpolated there, and each ADS line minus temperature's, seed by seed.
- **gaps**: each ADS point's student minus the temperature curve's at the point's own teacher accuracy.
- **crossings** (the ADS paper's measure): the teacher accuracy at which a line's distilled student falls to
  the undistilled student's accuracy, interpolated, seed by seed; None where the sweep never gets there.
- **crossing_gaps**: per ADS line, its crossing minus temperature's, seed by seed, judged on that paired
  interval: "ADS's crossing lies above temperature's" (a higher crossing: the students reach the undistilled
  level with the teacher still more accurate) holds, is within noise, or does not hold (reversed). Computed
  only where both lines cross in every seed; otherwise `missing` names the line that did not, and in how
  many seeds.
- **attackers**: per ADS point, the ADS-scored on-policy student minus the plain-scored control (one control
  per τ and seed, shared by every λ of that τ: said so); "damaged" when the student ends below where it
  started by its whole interval.
- **defences**: per defence of a served teacher (`defences`, and ADS at τ 1 as the reference), the defended
  attacker minus the control at τ 1, seed by seed, beside the defence's cost to honest users of the scores
  (`defences.py`).
"""

from __future__ import annotations

from opdkit.notebook import verdicts

RAW = "student_accuracy"
MEASURES = (
    "teacher_accuracy",
    "student_accuracy",
    "student_accuracy_forced",
    "student_holdout_loss",
    "opd_student_accuracy",
    "opd_student_accuracy_forced",
    "opd_student_holdout_loss",
    "opd_plain_student_accuracy",
    "opd_plain_student_accuracy_forced",
    "opd_plain_student_holdout_loss",
)
ADS_LABELS = {
    "ads": "ADS",
    "ads-answer": "ADS, answer-token gradient",
    "ads-confident": "ADS, gradient without the teacher's hesitations",
}
GRADIENT_NAMES = {"ads": "completion", "ads-answer": "answer-token", "ads-confident": "confident-token"}


def with_intervals(point: dict) -> dict:
    """The point with each measure the mean over its runs and `<measure>_ci` its interval (None: one run)."""
    runs = point.get("runs", [])
    out = dict(point)
    for key in MEASURES:
        values = [r.get(key) for r in runs]
        if any(v is not None for v in values):
            stat = verdicts.summarize(values)
            out[key], out[f"{key}_ci"] = stat["mean"], stat["ci"]
    return out


def lines(points: list[dict]) -> dict[str, list[dict]]:
    """The lines of the trade-off in sweep order: the temperature sweep (by τ), then one line per ADS method
    and ADS temperature (by λ), each starting at the λ = 0 point of its temperature when that was run."""
    out = {"temperature": sorted((p for p in points if p["lam"] == 0), key=lambda p: p["temperature"])}
    for method in dict.fromkeys(p["method"] for p in points if p["lam"] != 0):
        for tau in sorted({p["temperature"] for p in points if p["method"] == method}):
            start = [p for p in points if p["lam"] == 0 and p["temperature"] == tau]
            line = sorted(
                (p for p in points if p["method"] == method and p["temperature"] == tau),
                key=lambda p: p["lam"],
            )
            out[f"{ADS_LABELS.get(method, method)} (τ={tau:g})"] = start + line
    return out


def seeds_of(points: list[dict]) -> list[int]:
    return sorted({r["seed"] for p in points for r in p.get("runs", [])})


def at_seed(point: dict, seed: int, key: str) -> float | None:
    return next((r.get(key) for r in point.get("runs", []) if r["seed"] == seed), None)


def seed_curve(line: list[dict], seed: int, key: str = RAW) -> tuple[list[float], list[float]]:
    """One seed's (teacher accuracy, `key`) along a line, in sweep order, points it lacks left out."""
    pairs = [(at_seed(p, seed, "teacher_accuracy"), at_seed(p, seed, key)) for p in line]
    kept = [(x, y) for x, y in pairs if x is not None and y is not None]
    return [x for x, _ in kept], [y for _, y in kept]


def _claim(label: str) -> str:
    return f"{label} leaves its students less accurate than temperature sampling at equal teacher accuracy"


def point_gaps(points: list[dict], key: str = RAW) -> list[dict]:
    """Per ADS point: its student minus the temperature curve's at its own teacher accuracy, seed by seed
    (a seed whose point lies outside its temperature sweep's range is left out), judged on the interval."""
    temperature, seeds, out = lines(points)["temperature"], seeds_of(points), []
    for p in (p for p in points if p["lam"] != 0):
        diffs = []
        for seed in seeds:
            x, y = at_seed(p, seed, "teacher_accuracy"), at_seed(p, seed, key)
            ref = (
                None
                if x is None or y is None
                else verdicts.interpolate(*seed_curve(temperature, seed, key), x)
            )
            diffs.append(None if ref is None else y - ref)
        label = f"{ADS_LABELS.get(p['method'], p['method'])} λ={p['lam']:g} (τ={p['temperature']:g})"
        out.append(
            {"name": p["name"], "method": p["method"], **verdicts.verdict(_claim(label), diffs, above=False)}
        )
    return out


def matched(points: list[dict], key: str = RAW) -> dict:
    """Every line's student accuracy at one teacher accuracy that every line reaches in every seed (the
    highest of the lines' lowest), and each ADS line minus temperature's there, seed by seed. Empty when the
    lines share no teacher accuracy."""
    all_lines, seeds = lines(points), seeds_of(points)
    curves = {label: [seed_curve(line, s, key) for s in seeds] for label, line in all_lines.items()}
    curves = {label: c for label, c in curves.items() if all(xs for xs, _ in c)}
    if "temperature" not in curves or len(curves) < 2:
        return {}
    low = max(min(xs) for c in curves.values() for xs, _ in c)
    high = min(max(xs) for c in curves.values() for xs, _ in c)
    if low > high:
        return {}
    at = {label: [verdicts.interpolate(xs, ys, low) for xs, ys in c] for label, c in curves.items()}
    out = {"teacher_accuracy": low, "lines": []}
    for label, values in at.items():
        entry = {"label": label, **verdicts.summarize(values)}
        if label != "temperature":
            diffs = [
                a - b if a is not None and b is not None else None for a, b in zip(values, at["temperature"])
            ]
            entry["vs_temperature"] = verdicts.verdict(_claim(label), diffs, above=False)
        out["lines"].append(entry)
    return out


def crossings(points: list[dict], before: float | None, key: str = RAW) -> list[dict]:
    """Per line, the ADS paper's measure: the teacher accuracy at which its distilled student falls to the
    undistilled student's accuracy `before`, interpolated seed by seed (`verdicts.crossing`); `reached` of
    `seeds` got there within the sweep, `lowest_teacher` is the lowest teacher accuracy the line reached."""
    if before is None:
        return []
    seeds, out = seeds_of(points), []
    for label, line in lines(points).items():
        curves = [seed_curve(line, s, key) for s in seeds]
        found = [verdicts.crossing(xs, ys, before) for xs, ys in curves]
        lowest = [min(xs) for xs, _ in curves if xs]
        out.append(
            {
                "label": label,
                **verdicts.summarize(found),
                "reached": sum(x is not None for x in found),
                "seeds": len(seeds),
                "lowest_teacher": verdicts.summarize(lowest)["mean"],
                "by_seed": found,
            }
        )
    return out


def crossing_gaps(crossed: list[dict]) -> list[dict]:
    """Per ADS line of `crossed` (`crossings`): its crossing minus the temperature line's, paired seed by
    seed, and the verdict that it lies above temperature's; where either line did not cross in every seed
    (or no temperature line was run), no verdict (`word` "not measured") and `missing` lists {label,
    reached, seeds} of the lines that fell short."""
    by_label = {c["label"]: c for c in crossed}
    temperature = by_label.get("temperature")
    out = []
    for c in crossed:
        if c["label"] == "temperature":
            continue
        claim = f"{c['label']}'s crossing lies above temperature's"
        short = [
            {"label": x["label"], "reached": x["reached"], "seeds": x["seeds"]}
            for x in (c, temperature)
            if x is not None and x["reached"] < x["seeds"]
        ]
        if temperature is None:
            short.append({"label": "temperature", "reached": 0, "seeds": c["seeds"]})
        if short:
            none = {"word": "not measured", "mean": None, "ci": None, "n": 0}
            out.append({"label": c["label"], "claim": claim, **none, "missing": short})
            continue
        diffs = [a - b for a, b in zip(c["by_seed"], temperature["by_seed"])]
        out.append({"label": c["label"], **verdicts.verdict(claim, diffs, above=True), "missing": []})
    return out


def attackers(points: list[dict], before: float | None) -> list[dict]:
    """Per ADS point with on-policy attackers: the ADS-scored student (opd) minus its plain-scored control
    (opd-plain), seed by seed, judged on the interval; whether it ends below its start (`damaged`)."""
    out = []
    for p in (p for p in points if p["lam"] != 0 and p.get("opd_student_accuracy") is not None):
        seeds = [r["seed"] for r in p.get("runs", [])]
        opd = [at_seed(p, s, "opd_student_accuracy") for s in seeds]
        control = [at_seed(p, s, "opd_plain_student_accuracy") for s in seeds]
        diffs = [a - b if a is not None and b is not None else None for a, b in zip(opd, control)]
        label = f"{ADS_LABELS.get(p['method'], p['method'])} λ={p['lam']:g} (τ={p['temperature']:g})"
        claim = f"{label} slows the on-policy attacker against its control"
        ends = verdicts.interval(opd)
        below = (
            verdicts.word(ends, above=False, threshold=before)
            if before is not None and ends
            else "not measured"
        )
        out.append(
            {
                "name": p["name"],
                "lam": p["lam"],
                "temperature": p["temperature"],
                **verdicts.verdict(claim, diffs, above=False),
                "student": verdicts.summarize(opd),
                "control": verdicts.summarize(control),
                "damaged": below == verdicts.HOLDS,
                "below_start": below,
            }
        )
    return out


def findings(summary: dict) -> dict:
    """Everything the run concludes (the module's docstring), from its points and its baseline."""
    points, before = summary.get("points", []), summary.get("student_accuracy_before")
    crossed = crossings(points, before)
    return {
        "seeds": len(seeds_of(points)),
        "matched": matched(points),
        "gaps": point_gaps(points),
        "crossings": crossed,
        "crossing_gaps": crossing_gaps(crossed),
        "attackers": attackers(points, before),
        "defences": defences(points, before),
    }


CONTROL_TEMPERATURE = 1.0  # the defended attackers' control: opd-plain of the plain teacher at τ 1


def ads_label(lam: float) -> str:
    """How the defences' rows and costs name ADS-scored log-probabilities at λ (τ 1), the reference
    defence."""
    return f"ads:{lam:g}"


def defence_label(spec: str) -> str:
    """What the teacher's API returns under a defence (`teacher_defence`, or `ads_label`'s), in words."""
    kind, _, value = spec.partition(":")
    return {
        "topk": f"its top-{value} log-probs (and the scored token's)",
        "sampled": "the scored token's log-prob alone",
        "round": f"every log-prob rounded to {value} decimal{'s' if value != '1' else ''}",
        "noise": f"every log-prob plus noise of {value} nats",
        "ads": f"ADS-scored log-probs (λ {value})",
    }.get(kind, spec)


def _summarized(values: list) -> dict:
    return verdicts.summarize(values)


def _defence_row(spec, student, control, costs, teacher, before) -> dict:
    diffs = [a - b if a is not None and b is not None else None for a, b in zip(student, control)]
    claim = f"serving {defence_label(spec)} slows the on-policy attacker against its control"
    v = verdicts.verdict(claim, diffs, above=False)
    ends = verdicts.interval(student)
    below = "not measured" if before is None or not ends else verdicts.word(ends, False, before)
    return {
        "defence": spec,
        "label": defence_label(spec),
        **v,
        "damaged": below == verdicts.HOLDS,
        "wide": bool(v["ci"]) and (v["ci"][1] - v["ci"][0]) / 2 > WIDE,
        "student": _summarized(student),
        "control": _summarized(control),
        "kl": _summarized([c.get("kl") if c else None for c in costs]),
        "top1": _summarized([c.get("top1") if c else None for c in costs]),
        "teacher_accuracy": teacher,
    }


WIDE = 0.10  # an interval wider than ±10 points asks for 10 seeds (issue 50)


def control_point(points: list[dict]) -> dict | None:
    """The point the defended attackers ran at (λ 0, τ 1), when they did."""
    return next(
        (
            p
            for p in points
            if p["lam"] == 0
            and p["temperature"] == CONTROL_TEMPERATURE
            and any(r.get("defences") for r in p.get("runs", []))
        ),
        None,
    )


def defences(points: list[dict], before: float | None = None) -> list[dict]:
    """Per defended attacker (`defences`), then per ADS point at τ 1 (the reference defence, `opd`): its
    student minus the control (opd-plain at τ 1), seed by seed, judged on the interval ("holds": the defence
    slows it), beside what the defence costs honest users of the scores (KL(teacher || served) and the top-1
    agreement, means over seeds; None where it sends no distribution) and the teacher's accuracy (the
    control point's for a score-only defence, the ADS point's own for ADS). `wide`: an interval wider than
    ±10 points; `damaged`: the student ends below the undistilled student's accuracy `before` by its whole
    interval (the attacker's loss failed, beyond being slowed)."""
    control = control_point(points)
    if control is None:
        return []
    runs = control["runs"]
    seeds = [r["seed"] for r in runs]
    plain = [r.get("opd_plain_student_accuracy") for r in runs]
    teacher = _summarized([r.get("teacher_accuracy") for r in runs])
    specs = list(dict.fromkeys(s for r in runs for s in r.get("defences", {})))
    out = []
    for spec in specs:
        student = [r.get("defences", {}).get(spec, {}).get("student_accuracy") for r in runs]
        costs = [r.get("defence_costs", {}).get(spec) for r in runs]
        out.append(_defence_row(spec, student, plain, costs, teacher, before))
    ads = [
        p
        for p in points
        if p["method"] == "ads"
        and p["lam"] != 0
        and p["temperature"] == CONTROL_TEMPERATURE
        and p.get("opd_student_accuracy") is not None
    ]
    for p in ads:
        spec = ads_label(p["lam"])
        student = [at_seed(p, s, "opd_student_accuracy") for s in seeds]
        costs = [r.get("defence_costs", {}).get(spec) for r in runs]
        own = _summarized([at_seed(p, s, "teacher_accuracy") for s in seeds])
        out.append(_defence_row(spec, student, plain, costs, own, before))
    return out
