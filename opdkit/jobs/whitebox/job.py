"""White-box on-policy distillation, the job behind notebooks/02_whitebox.ipynb (its report: `report.py`): a
recipe over `opd.DistillTrainer` and the run lifecycle (`run.lifecycle`).

    python -m opdkit.whitebox --mode tiny                                    # CPU, ~2 minutes
    torchrun --nproc_per_node 4 -m opdkit.whitebox --mode full               # one node, 4 GPUs
    torchrun ... -m opdkit.whitebox --mode full --set parallelism=fsdp        # both models sharded (FSDP2)
    accelerate launch --num_machines 2 ... -m opdkit.whitebox --mode full    # many nodes
    python -m opdkit.whitebox --mode full --set teacher_server=http://node7:8000   # the teacher served there

`prepare` does everything that can fail cheaply (config, prompts, tokenizers) before anything is written; each
process loads the student and the teacher, measures greedy accuracy before, distils, measures it after.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from opdkit import memory
from opdkit.config import load_config, repeat_seeds
from opdkit.jobs.whitebox import seeds
from opdkit.jobs.whitebox.accuracy import accuracy_facts, kept_before, sharded_accuracies, step_measure
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.jobs.whitebox.inputs import Prepared, overlap_facts, prepared
from opdkit.jobs.whitebox.teacher import around_run, served_facts, served_teacher, several_teachers
from opdkit.models import load_model, load_tokenizer, num_params, resolve
from opdkit.notebook import verdicts
from opdkit.opd.stage import distill_stage
from opdkit.opd.teachers import served
from opdkit.opd.teachers.defended import defended
from opdkit.run import checkpoints, sharding
from opdkit.run.folders import RunDir, print0
from opdkit.run.launch import run_processes
from opdkit.run.lifecycle import Job, prepare_job, run_child, run_job
from opdkit.tasks.evaluate import evaluation_tokens

if TYPE_CHECKING:  # the trainer and its arguments import transformers' Trainer (seconds): not for a plan
    from opdkit.opd.arguments import OPDArguments
    from opdkit.opd.trainer import DistillTrainer


def processes(cfg: WhiteboxConfig) -> int:
    return run_processes(cfg.num_processes)


def stages(prep: Prepared, budget: float | None) -> dict[str, memory.Stage]:
    tokenizers = (prep.tokenizer, prep.teacher_tokenizer)  # as prepare loaded them: not loaded again
    return {"distillation": stage(prep.cfg, processes(prep.cfg), budget, tokenizers)}


def stage(
    cfg: WhiteboxConfig, world: int, budget: float | None, tokenizers: tuple | None = None
) -> memory.Stage:
    """What one process of this run holds (`opd.stage.distill_stage`)."""
    return distill_stage(cfg, world, budget, tokenizers)


def training_arguments(cfg: WhiteboxConfig, run_path: Path, eval_prompt_tokens: int = 0) -> OPDArguments:
    """The trainer's arguments (`opd.arguments.training_arguments`), checkpoints in the run's checkpoints/; a
    vLLM engine's context fits a rollout (with an `environment`, the longest prompt and an episode at its
    longest, `episode_tokens`) and, as it also evaluates the student, the longest evaluation prompt
    (`eval_prompt_tokens`) with its answer (an evaluation episode at its longest, `evaluation_tokens`)."""
    from opdkit.opd import arguments as opd_arguments

    return opd_arguments.training_arguments(
        cfg,
        str(run_path / "checkpoints"),
        run_name=f"{JOB.name}/{run_path.name}",
        vllm_max_model_len=max(
            cfg.max_prompt_length + cfg.episode_tokens(),
            eval_prompt_tokens + evaluation_tokens(cfg) if eval_prompt_tokens else 0,
        ),
    )


def process(prep: Prepared, run: RunDir, callbacks: list | None = None, title: str = "") -> None:
    """What every process runs: load the models, measure accuracy, distil, measure it again, write the
    summary (with `repeats` > 1: one such run per seed, `run_seeds`); then, with `ahead_arms`, the arms
    sampling ahead (`run_arms`). However it ends, the trainer's rollout engine is shut down, so a next run in
    this process (03's arms, Run All again) finds the memory free."""
    if prep.cfg.repeats > 1:
        run_seeds(prep, run, callbacks, title)
    else:
        distil_once(prep, run, callbacks, title)
    if prep.cfg.ahead_arms:
        run_arms(prep, run, callbacks, title)


def distil_once(prep: Prepared, run: RunDir, callbacks: list | None, title: str) -> None:
    """One whitebox run (in each of its processes): load, measure, distil, measure, summarise."""
    from opdkit.opd.build import distill_trainer

    t0, cfg = time.time(), prep.cfg
    args = training_arguments(cfg, run.path, prep.eval_prompt_tokens)  # starts the process group (N > 1)
    world, rank = args.world_size, args.process_index
    run.write_env(world_size=world)
    if cfg.parallelism == "fsdp" and world == 1:
        print0("parallelism fsdp with one process: nothing to shard, the student trains unsharded")
    student = load_model(cfg.student_model, torch.float32, args.device)
    teacher_dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    if cfg.teachers:
        teacher = several_teachers(cfg, prep, args.device, teacher_dtype)
        held = f"{len(cfg.teacher_specs())} teachers ({num_params(teacher) / 1e6:.2f}M params here)"
    elif cfg.teacher_server:
        teacher = served_teacher(cfg, prep, run, teacher_dtype)
        held = f"teacher served ({num_params(teacher) / 1e6:.2f}M head params here)"
    else:
        # A teacher the trainer shards (fsdp, several processes) waits in host memory: sharding moves it to
        # the device one unit at a time, so it never needs to fit a GPU whole.
        teacher_device = "cpu" if sharding.fsdp_arguments(cfg.parallelism, world) else args.device
        teacher = load_model(cfg.teacher_model, teacher_dtype, teacher_device)
        held = f"teacher {num_params(teacher) / 1e6:.2f}M"
    print0(f"student {num_params(student) / 1e6:.2f}M params, {held}, {world} process(es) on {args.device}")
    t_tok = None if cfg.teachers else load_tokenizer(cfg.teacher_model)
    trainer = distill_trainer(
        cfg,
        args,
        student,
        defended(teacher, cfg.teacher_defence, cfg.seed),  # teacher_defence: what the loss reads of it
        prep.tokenizer,
        prep.train_dataset,
        teacher_tokenizer=t_tok,
        run=run,
        callbacks=callbacks,
    )
    described = trainer.teacher.describe(resolve(cfg.teacher_model))
    if described:
        print0(described)
    try:
        distil(prep, run, trainer, teacher, world, rank, t0, title)
    finally:
        trainer.close_engine()
        if cfg.teacher_server:
            teacher.close()


def distil(
    prep: Prepared,
    run: RunDir,
    trainer: DistillTrainer,
    teacher,
    world: int,
    rank: int,
    t0: float,
    title: str = "",
) -> None:
    """Accuracy before (kept from the summary on resume), training, accuracy after, the summary."""
    from opdkit.notebook import live
    from opdkit.opd.callbacks import add_step_accuracy, report_samples

    cfg = prep.cfg
    # With vLLM the student's accuracies go through the trainer's engine (synced first), so they decode as its
    # rollouts do; the teacher's stay on the kit's loop (an engine for it would need memory of its own). A
    # producer sampling ahead (rollout_ahead) holds its engine in its own process: the kit's loop measures.
    engine = trainer.engine() if cfg.rollout_engine == "vllm" and not cfg.rollout_ahead else None
    trainer.rollouts.open()  # a producer sampling ahead (rollout_ahead) starts while the accuracy is measured
    acc = lambda m, e=None: sharded_accuracies(m, prep, world, rank, engine=e)  # noqa: E731
    last = (
        checkpoints.resume_checkpoint(run.path / "checkpoints", checkpoints.trainer_layout(trainer))
        if cfg.resume
        else None
    )
    earlier = run.read_summary() if last is not None and (run.path / "summary.json").exists() else {}
    # A served teacher has no decoding loop here: its accuracy is the server's to measure.
    # A teacher with another tokenizer decodes with its own; several teachers or a served one: no one
    # teacher's accuracy here (measure each with its own run).
    if cfg.teacher_server or cfg.teachers:
        teacher_acc = None
        teacher_text = "served, not measured here" if cfg.teacher_server else "several, not measured"
    else:
        teacher_acc = sharded_accuracies(teacher, prep, world, rank, tokenizer=trainer.teacher.tokenizer)
        teacher_text = verdicts.pct(teacher_acc.raw)
    before = kept_before(earlier) or acc(trainer.model, engine)
    print0(f"accuracy before: teacher {teacher_text}, student {verdicts.pct(before.raw)}")
    head = accuracy_facts(cfg, before, None, teacher_acc)
    run.write_summary({**head, "status": "training"})
    report_samples(trainer, cfg.report_to, run)
    live.notebook_view(
        trainer,
        max_grad_norm=cfg.max_grad_norm or None,
        title=title or f"{JOB.name} · {prep.mode}",
        reference={k: head[k] for k in ("teacher_accuracy", "student_accuracy_before")},
    )
    if cfg.eval_every and prep.eval_messages:

        def measure(m):
            return step_measure(sharded_accuracies(m, prep, world, rank, cfg.eval_every_size, engine, False))

        add_step_accuracy(trainer, measure, cfg.eval_every)
    if cfg.resume:
        run.truncate_logs(checkpoints.checkpoint_step(last) if last else 0)
    trainer.train(resume_from_checkpoint=str(last) if last else None)
    trainer.save_model(str(run.path / "model"))
    if rank == 0:
        prep.tokenizer.save_pretrained(run.path / "model")
    after = acc(trainer.trained_model(run.path / "model"), engine)
    summary = {
        **accuracy_facts(cfg, before, after, teacher_acc),
        "steps": trainer.state.global_step,
        "first_nonfinite_step": trainer.first_nonfinite_step,
        "prompts_dropped": prep.dropped,
        **overlap_facts(cfg, prep),
        **served_facts(cfg, teacher),
        "world_size": world,
        "wall_time_s": round(time.time() - t0, 1),
        "status": "stopped: non-finite gradient" if trainer.first_nonfinite_step else "done",
    }
    summary["finding"] = seeds.finding([summary])
    run.write_summary(summary)
    print0(f"accuracy after: student {verdicts.pct(after.raw)}")


def run_seeds(prep: Prepared, parent: RunDir, callbacks: list | None, title: str) -> None:
    """`repeats` > 1: one whitebox run per seed in seeds/seed<seed>/ (`lifecycle.run_child`; resume reuses
    the finished ones), gathered by `summarize`."""
    for seed in repeat_seeds(prep.cfg):
        label = f"{title or f'{JOB.name} · {prep.mode}'} · seed {seed}"
        print0(f"--- {label}")
        over = seeds.seed_overrides(prep.cfg, seed)
        path = seeds.seed_path(parent, seed)
        run_child(run, prep.mode, over, path, prep.cfg.resume, label, callbacks=callbacks, title=label)


def run_arms(prep: Prepared, parent: RunDir, callbacks: list | None, title: str) -> None:
    """`ahead_arms`: after the run itself, one whitebox run per arm in arms/<arm>/ at the same seeds and
    settings, sampling ahead (`lifecycle.run_child`; resume reuses the finished ones), compared by `ahead`."""
    from opdkit.jobs.whitebox import ahead  # with its figures (matplotlib): not for a dry run

    for arm in prep.cfg.arms():
        label = f"{title or f'{JOB.name} · {prep.mode}'} · ahead {arm.label}"
        print0(f"--- {label}")
        over = ahead.arm_overrides(prep.cfg, arm)
        path = ahead.arm_path(parent, arm)
        run_child(run, prep.mode, over, path, prep.cfg.resume, label, callbacks=callbacks, title=label)


def own_processes(prep: Prepared, run: RunDir) -> tuple[int, tuple]:
    """One process per GPU, or, with `repeats` > 1, this one: each seed's run launches its own; with
    `ahead_arms` this one (`inputs.check_ahead_arms` holds the run to one process)."""
    return (1 if prep.cfg.repeats > 1 or prep.cfg.ahead_arms else processes(prep.cfg)), ()


def summarize(prep: Prepared, run: RunDir, failure: str | None) -> dict | None:
    """A repeated run's summary from its seeds (`seeds.gather`); None for one run (its process wrote it);
    with `ahead_arms`, the comparison of the arms with this run under `ahead` (`ahead.comparison`)."""
    summary = seeds.gather(run, prep.cfg) if prep.cfg.repeats > 1 else None
    if not prep.cfg.ahead_arms:
        return summary
    from opdkit.jobs.whitebox import ahead

    return {**(summary if summary is not None else run.read_summary()), "ahead": ahead.comparison(run)}


JOB = Job(
    "whitebox",
    WhiteboxConfig,
    prepare=prepared,
    stages=stages,
    process=process,
    summarize=summarize,
    processes=own_processes,
    around=around_run,
)


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Everything that can fail cheaply, nothing written (`lifecycle.prepare_job`)."""
    return prepare_job(JOB, mode, overrides)


def memory_plan(cfg: WhiteboxConfig, budget: float | None) -> memory.JobPlan:
    """The run's memory plan per process against `budget` GB (None: nothing enforced)."""
    return memory.plan_job({"distillation": stage(cfg, processes(cfg), budget)}, budget)


def run(
    mode: str = "tiny",
    overrides: dict | None = None,
    prepared: Prepared | None = None,
    callbacks: list | None = None,
    *,
    child: bool = False,
    title: str = "",
) -> RunDir | None:
    """The run (`lifecycle.run_job`): its folder, or None after a dry run. `callbacks` (transformers
    `TrainerCallback`s) are handed to the trainer in every process; `title` names the live figure (03: the
    arm); `child`: a run inside another (`lifecycle.run_child`). `teacher_server: local` runs it beside the
    teacher's server (`teacher.around_run`)."""
    cfg = prepared.cfg if prepared is not None else load_config(WhiteboxConfig, mode, overrides)
    if cfg.teacher_server == served.LOCAL and not child:  # the server's own plan, beside the run's
        print0(served.server_plan(cfg, memory.budget_gb(cfg.plan_gpu_memory_gb)))
    return run_job(JOB, mode, overrides, prepared, child=child, callbacks=callbacks, title=title)
