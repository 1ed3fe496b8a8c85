"""Clip versus no clip, the job behind notebooks/03_clip_vs_noclip.ipynb (its report: `report.py`).

    python -m opdkit.cliplesson --mode tiny

The original's `noclip` mode changes two things at once: clipping off and the learning rate x5.
Every arm here is a whitebox run with the same data and seed; the two ablation arms change one
thing each, so the lesson can say how much of a blow-up is clipping and how much is learning rate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from opdkit import memory
from opdkit.config import load_config, repeat_seeds, to_dict
from opdkit.jobs import whitebox
from opdkit.jobs.cliplesson.arms import Arm, arm_overrides, arm_stats, arms, existing_arms, lesson_summary
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.run import tracking
from opdkit.run.folders import RunDir, print0
from opdkit.run.lifecycle import Job, prepare_job, run_child, run_job


def stages(prep: Prepared, budget: float | None) -> dict[str, memory.Stage]:
    """Every arm's whitebox stage (the arms run one after another); none when the arms are given runs. A dry
    run's arms plan with the tokenizers their prepare loaded, not loaded again."""
    if prep.existing:
        return {}
    out = {}
    for arm in prep.arms:
        arm_cfg = load_config(whitebox.WhiteboxConfig, arm.mode, arm_overrides(arm, prep.cfg))
        inputs = prep.arm_inputs.get(arm.name)
        tokenizers = (inputs.tokenizer, inputs.teacher_tokenizer) if inputs is not None else None
        out[arm.name] = whitebox.stage(arm_cfg, whitebox.processes(arm_cfg), budget, tokenizers)
    return out


# What the arms change that whitebox's inputs (`whitebox.prepare`: the prompts, measured against
# max_prompt_length, the evaluation problems, the tokenizers) do not read.
TRAINING_ONLY = frozenset({"learning_rate", "max_grad_norm", "optim", "optim_args", "run_dir", "resume"})


class SharedInputs:
    """Arms whose whitebox configs differ only in `TRAINING_ONLY` share one prepared input: the tiny world's
    20,000 training prompts are templated and measured once per seed, not once per arm (2.6 CPU-s each)."""

    def __init__(self) -> None:
        self.prepared: dict[str, object] = {}  # whitebox's Prepared, by the config it was made for

    def prepare(self, mode: str, overrides: dict) -> object:
        """`whitebox.prepare`, reused where an earlier arm's input fits (a dry run checks each arm's inputs
        with it: once, not once per arm)."""
        cfg = load_config(whitebox.WhiteboxConfig, mode, overrides)
        key = repr({k: v for k, v in to_dict(cfg).items() if k not in TRAINING_ONLY})
        if key in self.prepared:
            return dataclasses.replace(self.prepared[key], cfg=cfg, mode=mode)
        prep = self.prepared[key] = whitebox.prepare(mode, overrides)
        return prep

    def run(self, mode: str, overrides: dict, **kwargs) -> RunDir | None:
        """`whitebox.run`, its prepared input reused where an earlier arm's fits (a served teacher's run
        prepares its own: its server is started there)."""
        if load_config(whitebox.WhiteboxConfig, mode, overrides).teacher_server:
            return whitebox.run(mode, overrides, **kwargs)
        return whitebox.run(mode, overrides, prepared=self.prepare(mode, overrides), **kwargs)


def run_arm(
    arm: Arm, seed: int, cfg: ClipLessonConfig, lesson: RunDir, inputs: SharedInputs | None = None
) -> RunDir:
    """The arm's whitebox run in arms/<arm>-seed<seed>/, its live figure named after the arm
    (`lifecycle.run_child`: with resume=True a finished arm is reused, an unfinished one continues);
    `inputs`: the prepared inputs the lesson's arms share."""
    path = lesson.path / "arms" / f"{arm.name}-seed{seed}"
    over = {**arm_overrides(arm, cfg), "seed": seed}
    clipping = f"clip at {arm.max_grad_norm:g}" if arm.clipping else "no clipping"
    label = f"arm {arm.name} (seed {seed})"
    print0(f"--- {label}: {arm.optimizer} lr {arm.learning_rate:g}, {clipping}")
    title = f"{arm.name} · {arm.optimizer} lr {arm.learning_rate:g}, {clipping} · seed {seed}"
    run = (inputs or SharedInputs()).run
    return run_child(run, arm.mode, over, path, cfg.resume, label, title=title)


@dataclass
class Prepared:
    cfg: ClipLessonConfig
    mode: str
    arms: list[Arm]
    seeds: list[int]
    existing: list[tuple[Arm, str, int]]  # clip_run and noclip_run, when given
    arm_inputs: dict[str, object] = field(default_factory=dict)  # a dry run's: whitebox's Prepared, by arm


def prepared(cfg: ClipLessonConfig, mode: str) -> Prepared:
    """The arms and the seeds, and the given arm runs, checked before anything is written; a dry run also runs
    each arm's cheap checks (its data, tokenizers and model configs: whitebox's `prepare`)."""
    arm_list, existing = arms(cfg), existing_arms(cfg)
    arm_inputs = {}
    if cfg.dry_run and not existing:
        inputs = SharedInputs()
        for arm in arm_list:
            arm_inputs[arm.name] = inputs.prepare(arm.mode, {**arm_overrides(arm, cfg), "dry_run": True})
    elif cfg.dry_run:
        print0("dry run: clip_run / noclip_run are given, so nothing would be trained and nothing is planned")
    return Prepared(cfg, mode, arm_list, repeat_seeds(cfg), existing, arm_inputs)


def process(prep: Prepared, run: RunDir) -> None:
    """Every arm for every seed, one after another (each a whitebox run with its own processes)."""
    if not prep.existing:
        inputs = SharedInputs()
        for arm in prep.arms:
            for seed in prep.seeds:
                run_arm(arm, seed, prep.cfg, run, inputs)


def arm_runs(prep: Prepared, run: RunDir) -> list[tuple[Arm, RunDir, int]]:
    """(arm, its run folder, seed) of every arm run of the lesson: the given ones, or those in arms/."""
    if prep.existing:
        return [(arm, RunDir.attach(path), seed) for arm, path, seed in prep.existing]
    return [
        (arm, RunDir.attach(run.path / "arms" / f"{arm.name}-seed{seed}"), seed)
        for arm in prep.arms
        for seed in prep.seeds
    ]


def gather(prep: Prepared, run: RunDir, failure: str | None) -> dict:
    """The lesson's summary from its arms' folders (`arms.lesson_summary`)."""
    results: dict[str, dict[int, dict]] = {}
    for arm, arm_run, seed in arm_runs(prep, run):
        results.setdefault(arm.name, {})[seed] = arm_stats(arm_run, arm)
    return lesson_summary(results)


def track(prep: Prepared, run: RunDir, summary: dict) -> None:
    """The arms as one table, to the `report_to` tracker."""
    tracker = tracking.Tracker.start(prep.cfg.report_to, run, config=to_dict(prep.cfg))
    arms_ = summary["arms"].items()
    tracker.table(
        "arms", [{"arm": name, **{k: v for k, v in e.items() if k != "seeds"}} for name, e in arms_]
    )
    tracker.finish()


def one_process(prep: Prepared, run: RunDir) -> tuple[int, tuple]:
    return 1, ()  # the arms launch their own processes


JOB = Job(
    "cliplesson",
    ClipLessonConfig,
    prepare=prepared,
    stages=stages,
    process=process,
    summarize=gather,
    processes=one_process,
    track=track,
)


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Everything that can fail cheaply, nothing written (`lifecycle.prepare_job`)."""
    return prepare_job(JOB, mode, overrides)


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir | None:
    """Every arm's memory plan, then (unless `dry_run`) every arm for every seed, the summary (`run_job`)."""
    return run_job(JOB, mode, overrides, prepared)
