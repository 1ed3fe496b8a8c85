"""whitebox repeated over seeds (`repeats` > 1): one whitebox run per seed in seeds/seed<seed>/ of the run,
gathered into a summary of means with their 95 % intervals, and the finding's verdict.

    children = seed_runs(run)                       # the run itself when it has no seeds/
    summary = gather(run, cfg)                      # {measure: mean, measure_ci: [low, high], seeds: {...}}
    finding(summaries)                              # the lift after - before, judged on its interval

What a seed varies here: the order of the training prompts, the student's sampled rollouts, the held-out
problems when they are cut from a dataset (the tiny world's are fixed); the student starts from the same
weights. The before-accuracy is the same at every seed when the evaluation set is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from opdkit.config import repeat_seeds
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.notebook import verdicts
from opdkit.run.folders import RunDir

SEEDS_DIR = "seeds"
MEASURES = (
    "student_accuracy_before",
    "student_accuracy_after",
    "teacher_accuracy",
    "student_accuracy_before_forced",
    "student_accuracy_after_forced",
    "teacher_accuracy_forced",
    "student_tool_call_share_before",
    "student_tool_call_share_after",
    "teacher_tool_call_share",
)


def seed_path(run: RunDir, seed: int) -> Path:
    return run.path / SEEDS_DIR / f"seed{seed}"


def seed_overrides(cfg: WhiteboxConfig, seed: int) -> dict:
    """A seed's whitebox run: the parent's resolved settings with this seed, run once (the arms sampling
    ahead, `ahead_arms`, run beside the parent, not inside each seed)."""
    over = dataclasses.asdict(cfg)
    for name in ("run_dir", "overwrite", "resume", "dry_run"):
        over.pop(name)
    return {**over, "seed": seed, "repeats": 1, "ahead_arms": ""}


def seed_runs(run: RunDir) -> list[RunDir]:
    """The runs of every seed, in seed order; the run itself when it ran once."""
    folder = run.path / SEEDS_DIR
    if not folder.is_dir():
        return [run]
    paths = sorted(folder.glob("seed*"), key=lambda p: int(p.name[len("seed") :]))
    return [RunDir.attach(p) for p in paths if (p / "summary.json").is_file()]


def finding(summaries: list[dict]) -> dict:
    """02's finding, from one summary per seed: on-policy distillation lifts the student (after minus before,
    paired by seed), judged on its interval."""
    lifts = [
        s["student_accuracy_after"] - s["student_accuracy_before"]
        for s in summaries
        if s.get("student_accuracy_after") is not None and s.get("student_accuracy_before") is not None
    ]
    return verdicts.verdict("on-policy distillation lifts the student's held-out accuracy", lifts)


def gather(run: RunDir, cfg: WhiteboxConfig) -> dict:
    """The summary of a repeated run: each measure's mean over the seeds with its interval (`<measure>_ci`),
    the finding, every seed's own summary under `seeds`."""
    by_seed = {seed: RunDir.attach(seed_path(run, seed)) for seed in repeat_seeds(cfg)}
    summaries = {seed: r.read_summary() for seed, r in by_seed.items() if (r.path / "summary.json").is_file()}
    out: dict = {}
    for name in MEASURES:
        values = [s.get(name) for s in summaries.values()]
        if any(v is not None for v in values):
            stat = verdicts.summarize(values)
            out[name], out[f"{name}_ci"] = stat["mean"], stat["ci"]
    statuses = {s.get("status") for s in summaries.values()}
    done = len(summaries) == cfg.repeats and statuses <= {"done"}
    return {
        **out,
        "repeats": cfg.repeats,
        "interval": verdicts.INTERVAL_NAME,
        "finding": finding(list(summaries.values())),
        "steps": max((s.get("steps") or 0 for s in summaries.values()), default=0),
        "accuracy_precision": next((s.get("accuracy_precision") for s in summaries.values()), None),
        "seeds": summaries,
        "status": "done" if done else f"incomplete: {sorted(map(str, statuses))}",
    }
