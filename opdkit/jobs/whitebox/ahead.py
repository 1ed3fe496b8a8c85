"""What sampling ahead costs and buys (`ahead_arms`, issue 39): the synchronous run beside its arms, each a
whitebox run of its own in arms/<arm>/ at the same seeds and settings that samples its rollouts s steps ahead
(`rollout_ahead`), as they are or with the truncated importance correction (`async_correction`). Notebook
02's "Sampling ahead" section shows it; every number is computed here from the runs' files.

    python -m opdkit.whitebox --mode tiny-async-seeds        # or --set ahead_arms=1,1t,4,4t repeats=3
    c = comparison(run)                  # per arm: time, final accuracy, paired differences, ratios
    display(HTML(table_html(c))); figure(run); display(Markdown(explain(c)))

Per seed of each arm (its summary.json and metrics.jsonl): the final accuracy (`student_accuracy_after`),
the training time (the sum of the step times, each step's `completion_tokens / tokens_per_s`, so the accuracy
measured before and after is left out, and the `eval_every` measurement inside a step is in every arm alike)
and the steady rate from the second step on (the first waits for the producer's start-up where the accuracy
measured before training did not hide it),
the mean staleness of its rollouts and the importance ratios (`async/ratio_mean` averaged over the steps,
`async/ratio_max` the largest, `async/capped_share` averaged). Each arm is the mean over its seeds with its
95 % interval; against the synchronous run, and corrected against uncorrected at the same s, the per-seed
(paired) differences are judged (`notebook.verdicts`).

Forward against reverse KL (issue 50): two such runs of the same arms at the same seeds, one per `beta`
(`tiny-async-fkl-seeds`, `tiny-async-rkl-seeds`), read by `divergences`: per arm each divergence's cost (its
arm minus its own synchronous run, per seed) and forward's cost minus reverse's, paired by seed and judged.

    d = divergences(RunDir.attach(fkl_run), RunDir.attach(rkl_run))
    display(HTML(divergences_table_html(d))); display(Markdown(divergences_explain(d)))
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

from opdkit.config import ConfigError
from opdkit.jobs.whitebox.config import AheadArm, WhiteboxConfig, parse_ahead_arms
from opdkit.jobs.whitebox.seeds import seed_runs
from opdkit.notebook import figures as run_figures
from opdkit.notebook import verdicts
from opdkit.notebook.figures import CYCLE, MAX_WIDTH_IN, PALETTE, plt, styled
from opdkit.run.folders import RunDir

ARMS_DIR = "arms"
SYNC = "sync"  # the run itself, in `comparison`'s arms
HOW = (
    "This run has no arms sampling ahead. `-p ahead_arms 1,1t,4,4t` with `-p mode tiny-seeds` (or `-p mode "
    "tiny-async-seeds`) runs them beside it at the same seeds: rollouts sampled 1 and 4 steps ahead, as they "
    "are and with the truncated correction (docs/async.md)."
)
MEASURES = (
    "final_accuracy",
    "train_time_s",
    "steps_per_s",
    "steady_steps_per_s",
    "staleness",
    "ratio_mean",
    "ratio_max",
    "capped_share",
)


def arm_path(run: RunDir, arm: AheadArm) -> Path:
    return run.path / ARMS_DIR / arm.name


def arm_overrides(cfg: WhiteboxConfig, arm: AheadArm) -> dict:
    """An arm's whitebox run: the parent's resolved settings (its seeds, its repeats) with the arm's sampling
    ahead and correction, and no arms of its own."""
    over = dataclasses.asdict(cfg)
    for name in ("run_dir", "overwrite", "resume", "dry_run"):
        over.pop(name)
    return {**over, **arm.overrides()}


def arm_runs(run: RunDir) -> dict[str, RunDir]:
    """The synchronous run (`SYNC`, the run itself) and each finished arm in arms/<arm>/, by steps ahead and
    then uncorrected before corrected."""
    folder = run.path / ARMS_DIR
    names = [p.name for p in folder.iterdir() if (p / "summary.json").is_file()] if folder.is_dir() else []
    arms = sorted(parse_ahead_arms(",".join(names)), key=lambda a: (a.ahead, a.correction != "none"))
    return {SYNC: run, **{a.name: RunDir.attach(arm_path(run, a)) for a in arms}}


def by_seed(run: RunDir) -> dict[int, RunDir]:
    """A run's seed runs by seed (seeds/seed<seed>/), or the run itself at its config's seed."""
    runs = seed_runs(run)
    if runs == [run]:
        seed = run.read_config().get("seed", 0) if (run.path / "config.yaml").is_file() else 0
        return {int(seed): run}
    return {int(r.path.name[len("seed") :]): r for r in runs}


def _mean(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def seed_figures(run: RunDir) -> dict:
    """One seed's run: final accuracy, training time (sum of step times) and steps per second, the mean
    staleness and the importance ratios over its steps (None where the run logged none)."""
    summary = run.read_summary() if (run.path / "summary.json").is_file() else {}
    steps = (
        [r for r in run.read_jsonl() if r.get("loss") is not None]
        if (run.path / "metrics.jsonl").is_file()
        else []
    )
    times = [r["completion_tokens"] / r["tokens_per_s"] for r in steps if r.get("tokens_per_s")]
    train_time = sum(times) if times and len(times) == len(steps) else None
    steady = times[1:] if train_time else []  # the first step waits for a producer's start-up, if not hidden
    ratio_max = [r["async/ratio_max"] for r in steps if r.get("async/ratio_max") is not None]
    return {
        "final_accuracy": summary.get("student_accuracy_after"),
        "train_time_s": train_time,
        "steps": len(steps),
        "steps_per_s": len(steps) / train_time if train_time else None,
        "steady_steps_per_s": len(steady) / sum(steady) if steady else None,
        "staleness": _mean([r.get("async/staleness") for r in steps]),
        "ratio_mean": _mean([r.get("async/ratio_mean") for r in steps]),
        "ratio_max": max(ratio_max) if ratio_max else None,
        "capped_share": _mean([r.get("async/capped_share") for r in steps]),
        "status": summary.get("status"),
    }


def arm_of(name: str) -> AheadArm:
    return AheadArm(SYNC, 0, "none") if name == SYNC else parse_ahead_arms(name)[0]


def label(name: str) -> str:
    return "synchronous" if name == SYNC else arm_of(name).label


def divergence(beta: float | None) -> str:
    """The name of `beta`'s divergence: 0 forward KL, 1 reverse KL, between them the generalized JSD."""
    if beta is None:
        return "the divergence"
    return {0.0: "forward KL", 1.0: "reverse KL"}.get(float(beta), f"generalized JSD (beta {beta:g})")


def comparison(run: RunDir) -> dict:
    """Every arm against the synchronous run, from the runs' files (see the module's docstring): `beta`, the
    run's divergence (None where its config has none); per arm
    (`SYNC` first) its seeds' figures, each measure's mean with its interval (`<measure>_ci`), and for an
    arm the speed-up (synchronous training time over the arm's, per seed) and the paired verdict of its final
    accuracy against the synchronous run; `findings`, every paired verdict: staleness against synchronous,
    then the correction (corrected minus uncorrected at the same s)."""
    figs = {name: {s: seed_figures(r) for s, r in by_seed(a).items()} for name, a in arm_runs(run).items()}
    sync = figs[SYNC]
    arms, findings = {}, []
    for name, seeds in figs.items():
        arm = arm_of(name)
        entry: dict = {"label": label(name), "ahead": arm.ahead, "correction": arm.correction, "seeds": seeds}
        for key in MEASURES:
            stat = verdicts.summarize([f[key] for f in seeds.values()])
            entry[key], entry[f"{key}_ci"], entry["n"] = stat["mean"], stat["ci"], len(seeds)
        if name != SYNC:
            entry["speedup"] = verdicts.summarize(paired(sync, seeds, "train_time_s", ratio=True))
            entry["steady_speedup"] = verdicts.summarize(
                paired(seeds, sync, "steady_steps_per_s", ratio=True)
            )
            claim = f"{arm.label} ends less accurate than synchronous"
            v = verdicts.verdict(claim, paired(seeds, sync, "final_accuracy"), above=False)
            entry["against_sync"] = v
            findings.append({"kind": "staleness", "arm": name, "against": SYNC, **v})
        arms[name] = entry
    for name in arms:
        arm = arm_of(name)
        if arm.correction != "none" and str(arm.ahead) in arms:
            claim = f"at s={arm.ahead} the truncated correction ends more accurate than uncorrected"
            diffs = paired(figs[name], figs[str(arm.ahead)], "final_accuracy")
            findings.append(
                {
                    "kind": "correction",
                    "arm": name,
                    "against": str(arm.ahead),
                    **verdicts.verdict(claim, diffs),
                }
            )
    return {
        "beta": run.read_config().get("beta") if (run.path / "config.yaml").is_file() else None,
        "arms": arms,
        "findings": findings,
        "repeats": max((len(s) for s in figs.values()), default=0),
        "interval": verdicts.INTERVAL_NAME,
    }


def paired(a: dict[int, dict], b: dict[int, dict], key: str, ratio: bool = False) -> list[float]:
    """Per seed both have, a's `key` minus b's (or over it, `ratio`), in seed order."""
    out = []
    for seed in sorted(set(a) & set(b)):
        x, y = a[seed].get(key), b[seed].get(key)
        if x is not None and y is not None and (y or not ratio):
            out.append(x / y if ratio else x - y)
    return out


def _num(value: float | None, fmt: str = "{:.3g}") -> str:
    return "–" if value is None else fmt.format(value)


def _times(stat: dict | None) -> str:
    """'1.30× [1.21, 1.39]' of a {mean, ci, n} dict of ratios."""
    if not stat or stat.get("mean") is None:
        return "–"
    ci = stat.get("ci")
    return f"{stat['mean']:.2f}×" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def table_html(c: dict) -> str:
    """One row per arm: its sampling, training time and speed against synchronous, final accuracy, the paired
    difference against synchronous with its verdict, and the staleness and importance ratios."""
    head = [
        "arm",
        "rollout_ahead",
        "correction",
        "training time (s)",
        "speed vs synchronous",
        "steady speed (from step 2)",
        "final accuracy",
        "vs synchronous",
        "staleness",
        "ratio mean",
        "ratio max",
        "capped",
    ]
    rows = []
    for name, e in c["arms"].items():
        v = e.get("against_sync")
        diff = f"{verdicts.stat_text(v, signed=True)}, {v['word']}" if v else "–"
        rows.append(
            [
                f"<b>{e['label']}</b>",
                str(e["ahead"]),
                e["correction"],
                _num(e["train_time_s"], "{:.1f}"),
                _times(e.get("speedup")) if name != SYNC else "1×",
                _times(e.get("steady_speedup"))
                if name != SYNC
                else f"{_num(e['steady_steps_per_s'])} steps/s",
                verdicts.pct_interval(e["final_accuracy"], e["final_accuracy_ci"], e["n"]),
                diff,
                _num(e["staleness"], "{:.2f}"),
                _num(e["ratio_mean"], "{:.3f}"),
                _num(e["ratio_max"], "{:.3g}"),
                verdicts.pct(e["capped_share"], 2) if e["capped_share"] is not None else "–",
            ]
        )
    n = c.get("repeats", 1)
    caption = f"mean of {n} seeds [{verdicts.INTERVAL_NAME}]" if n > 1 else "one seed (no interval)"
    caption += "; differences and speed paired by seed; ratios: means over steps, max the largest"
    body = "".join("<tr>" + "".join(f"<td>{x}</td>" for x in r) + "</tr>" for r in rows)
    return (
        f"<table><caption>{caption}</caption><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>"
    )


def _finding(c: dict, kind: str, arm: str) -> dict | None:
    return next((f for f in c["findings"] if f["kind"] == kind and f["arm"] == arm), None)


def answer(c: dict, s: int) -> str:
    """At s steps ahead: does staleness lower the final accuracy against synchronous, and does the truncated
    correction undo it; one sentence from the verdicts."""
    hurt, fix = _finding(c, "staleness", str(s)), _finding(c, "correction", f"{s}t")
    corrected = _finding(c, "staleness", f"{s}t")
    if hurt is None:
        if corrected is None:
            return f"s={s}: not measured."
        return f"s={s}: only the corrected arm ran; against synchronous it is {corrected['word']}."
    lost = verdicts.stat_text(hurt, signed=True)
    if hurt["word"] == verdicts.HOLDS:
        head = f"At s={s} staleness **lowers** the final accuracy ({lost})"
        if fix is None:
            return head + "; no corrected arm ran to undo it."
        if fix["word"] == verdicts.HOLDS:
            back = verdicts.stat_text(fix, signed=True)
            rest = "" if corrected["word"] == verdicts.HOLDS else ", to within noise of synchronous"
            return head + f", and the truncated correction **wins it back** ({back}{rest})."
        return (
            head
            + f"; the truncated correction does not undo it (corrected minus uncorrected: {fix['word']})."
        )
    if hurt["word"] == verdicts.FAILS:
        return (
            f"At s={s} the stale rollouts end **more** accurate than synchronous ({lost}): nothing to undo."
        )
    tail = (
        ""
        if fix is None
        else f"; corrected minus uncorrected: {fix['word']} ({verdicts.stat_text(fix, signed=True)})"
    )
    return f"At s={s} no loss from staleness shows: {hurt['word']} ({lost}){tail}."


def explain(c: dict) -> str:
    """The AsyncOPD question answered from the verdicts, then each verdict, the speed and the ratios."""
    arms = {k: e for k, e in c["arms"].items() if k != SYNC}
    if not arms:
        return HOW
    n = c.get("repeats", 1)
    steps = sorted({e["ahead"] for e in arms.values()})
    lines = [
        f"**Does staleness hurt {divergence(c.get('beta'))} here, and does the correction undo it?** "
        + " ".join(answer(c, s) for s in steps)
    ]
    lines += [f"- {verdicts.sentence(f)}" for f in c["findings"]]
    sync = c["arms"][SYNC]
    for e in arms.values():
        lines.append(
            f"- {e['label']}: trains at {_times(e.get('speedup'))} the synchronous speed "
            f"({_num(e['train_time_s'], '{:.1f}')} s of steps against "
            f"{_num(sync['train_time_s'], '{:.1f}')} s), {_times(e.get('steady_speedup'))} from the second "
            "step on; "
            f"staleness {_num(e['staleness'], '{:.2f}')} steps, importance ratio mean "
            f"{_num(e['ratio_mean'], '{:.3f}')}, max {_num(e['ratio_max'])}, "
            f"{verdicts.pct(e['capped_share'], 2)} of tokens past the cap (means over seeds)."
        )
    if n < 3:
        lines.append(
            f"- {n} seed{'s' if n != 1 else ''}: a verdict needs an interval; `-p mode tiny-async-seeds` "
            "runs every arm at 3 seeds, paired by seed."
        )
    return "\n".join(lines)


def costs(c: dict, name: str) -> dict[int, dict]:
    """Per seed of arm `name` in a `comparison`: its final accuracy minus the synchronous run's (`cost`,
    negative where staleness lost accuracy)."""
    sync, arm = c["arms"][SYNC]["seeds"], c["arms"][name]["seeds"]
    out = {}
    for seed in sorted(set(arm) & set(sync)):
        x, y = arm[seed]["final_accuracy"], sync[seed]["final_accuracy"]
        if x is not None and y is not None:
            out[seed] = {"cost": x - y}
    return out


def divergences(forward: RunDir, reverse: RunDir) -> dict:
    """Does staleness cost forward KL less than reverse KL: two finished `ahead_arms` runs of the same arms at
    the same seeds, one per `beta` (the module's docstring). Per arm both ran (`SYNC` first): each side's
    final accuracy and its verdict against its own synchronous run (`comparison`'s), and `difference`,
    forward's cost minus reverse's per seed (for `SYNC`: forward's final accuracy minus reverse's), judged
    "costs forward KL less" (above 0); `findings`, those verdicts of the arms sampling ahead."""
    sides = {"forward": comparison(forward), "reverse": comparison(reverse)}
    names = {side: divergence(c["beta"]) for side, c in sides.items()}
    if names["forward"] == names["reverse"]:
        raise ConfigError(
            f"divergences: both runs are {names['forward']}: give one run per divergence, e.g. "
            "tiny-async-fkl-seeds (beta 0) and tiny-async-rkl-seeds (beta 1)."
        )
    fwd, rev = (sides[side]["arms"] for side in ("forward", "reverse"))
    arms, findings = {}, []
    for name in (n for n in fwd if n in rev):
        e = {"label": fwd[name]["label"], "ahead": fwd[name]["ahead"], "correction": fwd[name]["correction"]}
        for side, arm in (("forward", fwd[name]), ("reverse", rev[name])):
            e[side] = {k: arm[k] for k in ("final_accuracy", "final_accuracy_ci", "n")}
            e[side]["against_sync"] = arm.get("against_sync")
        if name == SYNC:
            claim = f"synchronous {names['forward']} ends more accurate than {names['reverse']}"
            diffs = paired(fwd[SYNC]["seeds"], rev[SYNC]["seeds"], "final_accuracy")
        else:
            claim = f"at {e['label']} staleness costs {names['forward']} less than {names['reverse']}"
            diffs = paired(costs(sides["forward"], name), costs(sides["reverse"], name), "cost")
            e["cost_by_seed"] = {
                side: {s: d["cost"] for s, d in costs(sides[side], name).items()} for side in sides
            }
        e["difference"] = verdicts.verdict(claim, diffs)
        if name != SYNC:
            findings.append({"kind": "divergence", "arm": name, **e["difference"]})
        arms[name] = e
    return {
        "divergences": names,
        "beta": {side: c["beta"] for side, c in sides.items()},
        "arms": arms,
        "findings": findings,
        "repeats": min(sides["forward"]["repeats"], sides["reverse"]["repeats"]),
        "interval": verdicts.INTERVAL_NAME,
    }


def _verdict_text(v: dict | None) -> str:
    return f"{verdicts.stat_text(v, signed=True)}, {v['word']}" if v else "–"


def divergences_table_html(d: dict) -> str:
    """One row per arm: each divergence's final accuracy and its difference against its own synchronous run,
    then forward's cost minus reverse's, each with its verdict."""
    fwd, rev = d["divergences"]["forward"], d["divergences"]["reverse"]
    head = [
        "arm",
        f"{fwd}: final accuracy",
        f"{fwd}: vs its synchronous",
        f"{rev}: final accuracy",
        f"{rev}: vs its synchronous",
        f"{fwd}'s cost minus {rev}'s",
    ]
    rows = [
        [
            f"<b>{e['label']}</b>",
            *(
                x
                for side in ("forward", "reverse")
                for x in (
                    verdicts.pct_interval(
                        e[side]["final_accuracy"], e[side]["final_accuracy_ci"], e[side]["n"]
                    ),
                    _verdict_text(e[side]["against_sync"]),
                )
            ),
            _verdict_text(e["difference"]) + (" (accuracy, not cost)" if name == SYNC else ""),
        ]
        for name, e in d["arms"].items()
    ]
    n = d.get("repeats", 1)
    caption = f"mean of {n} seeds [{verdicts.INTERVAL_NAME}]" if n > 1 else "one seed (no interval)"
    caption += (
        "; every difference paired by seed; a cost is an arm's final accuracy minus its synchronous run's"
    )
    body = "".join("<tr>" + "".join(f"<td>{x}</td>" for x in r) + "</tr>" for r in rows)
    return (
        f"<table><caption>{caption}</caption><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{body}</table>"
    )


def divergences_explain(d: dict) -> str:
    """The AsyncOPD claim answered from the verdicts (forward KL robust to staleness, reverse KL not), then
    each verdict."""
    fwd, rev = d["divergences"]["forward"], d["divergences"]["reverse"]
    found = d["findings"]
    less = [f for f in found if f["word"] == verdicts.HOLDS]
    more = [f for f in found if f["word"] == verdicts.FAILS]
    parts = [f"**yes** at {', '.join(label(f['arm']) for f in less)}"] if less else []
    if more:
        parts.append(f"**no**, it costs {fwd} more at {', '.join(label(f['arm']) for f in more)}")
    if not found:
        answer = "no arm sampling ahead ran under both."
    elif not parts:
        answer = f"no difference shows at {d['repeats']} seeds: every arm's is within noise."
    else:
        answer = "; ".join(parts) + (
            "; elsewhere within noise." if len(less) + len(more) < len(found) else "."
        )
    lines = [f"**Does staleness cost {fwd} less than {rev} here?** {answer}"]
    lines += [f"- {verdicts.sentence(f)}" for f in found]
    sync = d["arms"].get(SYNC)
    if sync:
        lines.append(f"- {verdicts.sentence(sync['difference'])}")
    return "\n".join(lines)


def arm_style(name: str, steps: list[int]) -> dict:
    """Synchronous black; each s its own colour, uncorrected dashed, corrected solid."""
    if name == SYNC:
        return {"color": PALETTE["black"], "ls": "-"}
    arm = arm_of(name)
    return {
        "color": CYCLE[steps.index(arm.ahead) % (len(CYCLE) - 1)],
        "ls": "-" if arm.correction != "none" else "--",
    }


PANELS = (
    ("eval_accuracy", "held-out accuracy while training", "greedy accuracy (eval_every)"),
    ("async/ratio_mean", "importance ratio, mean per step", "π_student / π_sampler"),
    ("async/ratio_max", "importance ratio, max per step", "π_student / π_sampler (log scale)"),
)


@styled
def draw(records: dict[str, list[list[dict]]], cap: float | None = None, path=None):
    """Accuracy over steps of every arm and the importance ratios' mean and max per step of each arm that
    samples ahead: the seeds' mean, the accuracy with its 95 % band when there are several (a band per step
    of the ratios, 300 of them, hides the lines; the max's on a log scale goes below zero)."""
    fig, axes = plt.subplots(1, 3, figsize=(MAX_WIDTH_IN, 3.9))
    steps = sorted({arm_of(n).ahead for n in records if n != SYNC})
    for ax, (key, title, unit) in zip(axes, PANELS):
        for name, runs in records.items():
            if name == SYNC and key != "eval_accuracy":
                continue
            style = arm_style(name, steps)
            marker = "o" if key == "eval_accuracy" else None
            if len(runs) > 1:
                x, mean, low, high = run_figures.band_series(runs, key)
                ax.plot(x, mean, lw=1.3, marker=marker, ms=3, label=label(name), **style)
                if key == "eval_accuracy":
                    ax.fill_between(x, low, high, color=style["color"], alpha=0.15, lw=0)
            elif runs:
                ax.plot(
                    *run_figures.series(runs[0], key), lw=1.2, marker=marker, ms=3, label=label(name), **style
                )
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(unit)
    run_figures.percent_axis(axes[0])
    axes[1].axhline(1.0, color=PALETTE["grey"], ls=":", lw=1)
    axes[2].set_yscale("log")
    if cap:
        line = axes[2].axhline(cap, color=PALETTE["grey"], ls=":", lw=1, label=f"cap {cap:g} (corrected)")
        axes[2].legend(handles=[line], loc="upper left")
    handles, labels = axes[0].get_legend_handles_labels()
    n = max((len(r) for r in records.values()), default=1)
    seeds = f"; mean of {n} seeds, band: 95 % interval" if n > 1 else ""
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)) or 1, frameon=False)
    fig.suptitle(f"sampling ahead: dashed as sampled, solid corrected{seeds}")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    if path:
        fig.savefig(path)
    return fig


def figure(run: RunDir):
    """`draw` from the run's arms (every seed's metrics.jsonl), saved as figures/sampling_ahead.png."""
    records = {name: [r.read_jsonl() for r in by_seed(a).values()] for name, a in arm_runs(run).items()}
    cap = run.read_config().get("async_ratio_cap") if (run.path / "config.yaml").is_file() else None
    return draw(records, cap, path=run.figure("sampling_ahead"))
