"""White-box on-policy distillation, the job behind notebooks/02_whitebox.ipynb (its report: `report.py`).

    python -m opdkit.whitebox --mode tiny                                    # CPU, ~2 minutes
    torchrun --nproc_per_node 4 -m opdkit.whitebox --mode full               # one node, 4 GPUs
    torchrun ... -m opdkit.whitebox --mode full --set parallelism=fsdp        # both models sharded (FSDP2)
    accelerate launch --num_machines 2 ... -m opdkit.whitebox --mode full    # many nodes

`prepare` does everything that can fail cheaply (config, tokenizers, prompts) before anything is
written; `run` creates the run directory and launches `process` in every process.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from opdkit import memory
from opdkit.config import ConfigError, load_config
from opdkit.data import prompts, tasks
from opdkit.jobs import savegrad
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.models import check_tokenizers, checkpointing_argument, load_model, load_tokenizer, num_params
from opdkit.notebook import live
from opdkit.opd.callbacks import StepAccuracy
from opdkit.opd.trainer import DistillTrainer, OPDArguments
from opdkit.rollout import engines, evaluate
from opdkit.run import checkpoints, sharding, tracking
from opdkit.run.cli import run_from_cli
from opdkit.run.folders import RunDir, print0
from opdkit.run.launch import default_num_processes, launched_world_size, start_run, under_external_launcher

JOB = WhiteboxConfig.job


@dataclass
class Prepared:
    cfg: WhiteboxConfig
    mode: str
    task: tasks.Task
    tokenizer: object
    train_dataset: object  # datasets.Dataset of prompts: messages, answer
    eval_messages: list
    eval_answers: list
    dropped: int
    first_prompt: str
    plan: memory.JobPlan  # what each process will hold, from the models' config.json
    eval_prompt_tokens: int = 0  # the longest evaluation prompt, chat-templated (sizes a vLLM engine)
    removed: dict[str, int] = field(default_factory=tasks.removed)  # rows passed over to keep sets apart

    @property
    def train_messages(self) -> list[list[dict]]:
        return list(self.train_dataset["messages"])


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Resolve the config, then the prompts, then the tokenizers, as the original does (the data file in
    milliseconds, before any download): every cheap failure happens here, before anything is written."""
    cfg = load_config(WhiteboxConfig, mode, overrides)
    tracking.check_report_to(cfg.report_to)
    task = tasks.for_dataset(cfg.dataset_path)
    exclude = prompts.prompt_keys(excluded_holdout(cfg.exclude_run)) if cfg.exclude_run else set()
    split = task.split(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.eval_size, cfg.seed, exclude)
    train, msgs, answers = split.train, split.eval_messages, split.eval_answers
    tok = load_tokenizer(cfg.student_model)
    check_tokenizers(tok, load_tokenizer(cfg.teacher_model))
    train, dropped = prompts.filter_long_prompts(train, tok, cfg.max_prompt_length, cfg.enable_thinking)
    collator = prompts.PromptCollator(tok, cfg.max_prompt_length, cfg.enable_thinking)
    first = prompts.format_first_prompt(train, collator, tok)
    engines.check_available(cfg.rollout_engine, cfg.dry_run)  # an import check, after the data and tokenizers
    if cfg.rollout_engine == "vllm" and cfg.vllm_sleep and torch.cuda.device_count() == 0:
        raise ConfigError("vllm_sleep needs CUDA GPUs (vLLM has no sleep mode on CPU); set vllm_sleep false.")
    longest = max((len(prompts.prompt_ids(tok, m, cfg.enable_thinking)) for m in msgs), default=0)
    plan = memory_plan(cfg, memory.budget_gb(cfg.plan_gpu_memory_gb))
    return Prepared(cfg, mode, task, tok, train, msgs, answers, dropped, first, plan, longest, split.removed)


def processes(cfg: WhiteboxConfig) -> int:
    """The processes the run will have: the launcher's, or `num_processes` (0: every visible GPU)."""
    return launched_world_size() if under_external_launcher() else default_num_processes(cfg.num_processes)


def stage(cfg: WhiteboxConfig, world: int, budget: float | None) -> memory.Stage:
    """What one process of this run holds, for the memory plan: the fp32 student (bf16 autocast), its
    optimizer, the teacher, every prompt of an optimizer step sampled at once (the kit's loop) or the vLLM
    engine's share, and the greedy evaluation of the teacher. Planned for a GPU when there is a budget."""
    return memory.Stage(
        student=memory.ModelShape.from_config(cfg.student_model),
        teacher=memory.ModelShape.from_config(cfg.teacher_model),
        student_dtype="float32",
        teacher_dtype=engine_dtype(cfg.bf16),
        bf16=cfg.bf16,
        device="cpu" if budget is None else "cuda",
        optimizer=memory.optimizer_kind(cfg.optim, cfg.optim_args),
        parallelism=cfg.parallelism,
        world_size=world,
        shard_teacher=True,  # DistillTrainer shards the teacher too under fsdp with several processes
        gradient_checkpointing=cfg.gradient_checkpointing,
        prompt_len=cfg.max_prompt_length,
        completion_len=cfg.max_new_tokens,
        train_batch_size=cfg.per_device_train_batch_size,
        loss_chunk_size=cfg.loss_chunk_size,
        gen_batch_size=cfg.per_device_train_batch_size * cfg.accumulation_steps(world),
        eval_model="teacher",
        eval_batch_size=cfg.eval_batch_size if cfg.eval_size else 0,
        eval_completion_len=eval_new_tokens(cfg),
        rollout_engine=cfg.rollout_engine,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_sleep=cfg.vllm_sleep,
        engine_dtype=engine_dtype(cfg.bf16),
        sync_streamed=True,  # VLLMEngine.sync hands the weights over one tensor at a time
    )


def memory_plan(cfg: WhiteboxConfig, budget: float | None) -> memory.JobPlan:
    """The run's memory plan per process against `budget` GB (None: nothing enforced)."""
    return memory.plan_job({"distillation": stage(cfg, processes(cfg), budget)}, budget)


def excluded_holdout(run_dir: str) -> list[list[dict]]:
    """The holdout prompts of the savegrad run `exclude_run` names."""
    holdout = savegrad.run_holdout(run_dir)
    if holdout is None:
        raise ConfigError(
            f"exclude_run={run_dir!r} has neither config.yaml nor traces/, so its holdout prompts are "
            "unknown; point it to the savegrad run directory itself."
        )
    return holdout


def accuracy_precision(cfg: WhiteboxConfig) -> str:
    """How the run's accuracies decode. With the kit's loop every model decodes at the precision the
    student samples its rollouts at; with vLLM the student's (before, while and after training) decode in
    the engine at its weights' dtype, the teacher's on the kit's loop."""
    loop = "bf16 autocast" if cfg.bf16 else "fp32"
    if cfg.rollout_engine == "hf":
        return loop
    return f"student vLLM {engine_dtype(cfg.bf16)}, teacher {loop}"


def engine_dtype(bf16: bool) -> str:
    return "bfloat16" if bf16 else "float32"


def sharded_accuracy(
    model, prep: Prepared, world: int, rank: int, limit: int | None = None, engine=None
) -> float | None:
    """Raw greedy accuracy (`sharded_accuracies` without forcing)."""
    return sharded_accuracies(model, prep, world, rank, limit, engine, forced=False)[0]


def sharded_accuracies(
    model,
    prep: Prepared,
    world: int,
    rank: int,
    limit: int | None = None,
    engine=None,
    forced: bool | None = None,
) -> tuple[float | None, float | None]:
    """(raw, forced) greedy accuracy with the evaluation set (its first `limit` problems) split across
    processes and the counts summed; forced (each final answer forced, `evaluate.forced_completions`) only
    when `forced` (default: the config's `forced_accuracy`), else None. The kit's loop decodes every model
    under the same autocast (`accuracy_precision`), so before and after compare one precision; a vLLM
    `engine` is first synced with `model` on every rank (a sharded model's sync gathers) and decodes from
    those weights.

    A sharded model (the teacher under FSDP) decodes in step: its every forward is a collective, so every
    rank decodes as many prompts (where they do not divide, some repeat one whose answer is not counted)
    with the kit's loop synced, each batch stepping until every rank's batch is done."""
    cfg, tok = prep.cfg, prep.tokenizer
    forced = cfg.forced_accuracy if forced is None else forced
    messages, answers = prep.eval_messages[:limit], prep.eval_answers[:limit]
    if not messages:
        return None, None
    if engine is not None:
        engine.sync(model)
    mine = list(range(rank, len(messages), world))
    decoded = mine
    if world > 1 and sharding.is_sharded(model) and engine is None:
        engine = engines.make_engine("hf", synced=True)
        decoded = mine + [(mine or [0])[-1]] * (-(-len(messages) // world) - len(mine))
    correct, correct_forced = 0.0, 0.0
    device = next(model.parameters()).device
    if decoded:
        mine_messages = [messages[i] for i in decoded]
        loop = engine is None or engine.name == "hf"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16 and loop):
            comps = evaluate.greedy_completions(
                model,
                tok,
                mine_messages,
                max_new_tokens=eval_new_tokens(cfg),
                batch_size=cfg.eval_batch_size,
                enable_thinking=cfg.enable_thinking,
                progress=rank == 0,
                engine=engine,
            )
            if forced:
                comps_forced = evaluate.forced_completions(
                    model,
                    tok,
                    mine_messages,
                    comps,
                    prep.task,
                    batch_size=cfg.eval_batch_size,
                    enable_thinking=cfg.enable_thinking,
                    engine=engine,
                )
                correct_forced = float(
                    sum(prep.task.check(c, answers[i]) for c, i in zip(comps_forced, mine))
                )
        # zip stops at this rank's own prompts: the repeats decoded only to keep step are not counted.
        correct = float(sum(prep.task.check(c, answers[i]) for c, i in zip(comps, mine)))
    if world > 1 and dist.is_initialized():
        t = torch.tensor([correct, correct_forced], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        correct, correct_forced = t.tolist()
    return correct / len(messages), correct_forced / len(messages) if forced else None


def eval_new_tokens(cfg: WhiteboxConfig) -> int:
    return cfg.eval_max_new_tokens or cfg.max_new_tokens


def training_arguments(cfg: WhiteboxConfig, run_path: Path, eval_prompt_tokens: int = 0) -> OPDArguments:
    """The original's TrainingArguments plus the distillation's own settings: every field the config shares
    with `OPDArguments` by name, and the few a job translates (max_grad_norm 0 means never clip). A vLLM
    engine's context fits a rollout and, as it also evaluates the student, the longest evaluation prompt
    (`eval_prompt_tokens`, not cut) with its answer."""
    return OPDArguments.from_config(
        cfg,
        output_dir=str(run_path / "checkpoints"),
        remove_unused_columns=False,
        warmup_steps=cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio
        optim_args=cfg.optim_args or None,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"),
        **checkpointing_argument(cfg.gradient_checkpointing),
        gradient_accumulation_steps=cfg.accumulation_steps(launched_world_size()),
        data_seed=cfg.seed,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # a NaN loss must show, not be replaced by the running mean
        eval_steps=None,  # the job measures accuracy itself (StepAccuracy), not through Trainer.evaluate
        save_strategy="steps",
        save_steps=cfg.save_steps if cfg.save_steps > 0 else 10**9,
        project=tracking.PROJECT,  # trackio's project; wandb takes WANDB_PROJECT
        run_name=f"{JOB}/{run_path.name}",
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=int(os.environ.get("RANK", "0")) != 0,
        **sharding.fsdp_arguments(cfg.parallelism, launched_world_size()),
        vllm_max_model_len=max(
            cfg.max_prompt_length + cfg.max_new_tokens,
            eval_prompt_tokens + eval_new_tokens(cfg) if eval_prompt_tokens else 0,
        ),
    )


def process(
    cfg_dict: dict, mode: str, run_path: str, prepared: Prepared | None = None, callbacks: list | None = None
) -> None:
    """What every process runs (`_distil`); however it ends, the trainer's rollout engine is shut down, so a
    next run in this process (03's arms, Run All again) finds the memory free."""
    trainers: list[DistillTrainer] = []
    try:
        _distil(cfg_dict, mode, run_path, prepared, callbacks, trainers)
    finally:
        for trainer in trainers:
            trainer.close_engine()


def _distil(
    cfg_dict: dict,
    mode: str,
    run_path: str,
    prepared: Prepared | None,
    callbacks: list | None,
    trainers: list[DistillTrainer],
) -> None:
    """Load models, evaluate, distil, evaluate, save, summarize; the trainer goes into `trainers`."""
    t0 = time.time()
    cfg = WhiteboxConfig(**cfg_dict)
    prep = prepared or prepare(mode, {k: v for k, v in cfg_dict.items() if k not in ("overwrite", "resume")})
    run = RunDir.attach(run_path)
    # Initialises the process group in multi-process runs.
    args = training_arguments(cfg, run.path, prep.eval_prompt_tokens)
    world, rank = args.world_size, args.process_index
    run.write_env(world_size=world)
    if cfg.parallelism == "fsdp" and world == 1:
        print0("parallelism fsdp with one process: nothing to shard, the student trains unsharded")
    tok = prep.tokenizer
    student = load_model(cfg.student_model, torch.float32, args.device)
    # A teacher the trainer shards (fsdp, several processes) waits in host memory: sharding moves it to
    # the device one unit at a time, so it never needs to fit a GPU whole.
    teacher_device = "cpu" if sharding.fsdp_arguments(cfg.parallelism, world) else args.device
    teacher = load_model(cfg.teacher_model, torch.bfloat16 if cfg.bf16 else torch.float32, teacher_device)
    print0(
        f"student {num_params(student) / 1e6:.2f}M params, teacher {num_params(teacher) / 1e6:.2f}M, "
        f"{world} process(es) on {args.device}"
    )

    trainer = DistillTrainer(
        model=student,
        args=args,
        train_dataset=prep.train_dataset,
        data_collator=prompts.PromptCollator(tok, cfg.max_prompt_length, cfg.enable_thinking),
        processing_class=tok,
        teacher_model=teacher,
        teacher_tokenizer=load_tokenizer(cfg.teacher_model),
        run=run,
        callbacks=callbacks,
    )
    trainers.append(trainer)
    # With vLLM the student's accuracies go through the trainer's engine (synced first), so they decode as
    # its rollouts do; the teacher's stay on the kit's loop (an engine for it would need memory of its own).
    engine = trainer.engine() if cfg.rollout_engine == "vllm" else None
    acc = lambda m, e=None: sharded_accuracies(m, prep, world, rank, engine=e)  # noqa: E731
    last = (
        checkpoints.resume_checkpoint(run.path / "checkpoints", checkpoints.trainer_layout(trainer))
        if cfg.resume
        else None
    )
    resumed = last is not None
    before = (
        run.read_summary().get("student_accuracy_before")
        if resumed and (run.path / "summary.json").exists()
        else None
    )
    before_forced = run.read_summary().get("student_accuracy_before_forced") if before is not None else None
    teacher_acc, teacher_forced = acc(teacher)
    if before is None:
        before, before_forced = acc(student, engine)
    print0(f"accuracy before: teacher {teacher_acc}, student {before}")
    forced_before = (
        {"student_accuracy_before_forced": before_forced, "teacher_accuracy_forced": teacher_forced}
        if cfg.forced_accuracy
        else {}
    )
    run.write_summary(
        {
            "student_accuracy_before": before,
            **forced_before,
            "teacher_accuracy": teacher_acc,
            "accuracy_precision": accuracy_precision(cfg),
            "status": "training",
        }
    )

    tracking.report_samples(trainer, cfg.report_to, run)
    live.notebook_view(trainer, max_grad_norm=cfg.max_grad_norm or None, title=f"{JOB} · {mode}")
    if cfg.eval_steps and prep.eval_messages:
        add_step_accuracy(
            trainer,
            lambda m: sharded_accuracy(m, prep, world, rank, cfg.eval_steps_size, engine),
            cfg.eval_steps,
        )
    if cfg.resume:
        truncate_metrics(run, checkpoints.checkpoint_step(last) if last else 0)
    trainer.train(resume_from_checkpoint=str(last) if last else None)
    trainer.save_model(str(run.path / "model"))
    if rank == 0:
        tok.save_pretrained(run.path / "model")
    after, after_forced = acc(trained_student(trainer, run.path / "model"), engine)
    summary = {
        "student_accuracy_before": before,
        "student_accuracy_after": after,
        "teacher_accuracy": teacher_acc,
        **forced_before,
        **({"student_accuracy_after_forced": after_forced} if cfg.forced_accuracy else {}),
        "accuracy_precision": accuracy_precision(cfg),
        "steps": trainer.state.global_step,
        "first_nonfinite_step": trainer.first_nonfinite_step,
        "prompts_dropped": prep.dropped,
        **overlap_facts(cfg, prep),
        "world_size": world,
        "wall_time_s": round(time.time() - t0, 1),
        "status": "stopped: non-finite gradient" if trainer.first_nonfinite_step else "done",
    }
    run.write_summary(summary)
    print0(f"accuracy after: student {after}")


def overlap_facts(cfg: WhiteboxConfig, prep: Prepared) -> dict:
    """The rows passed over to keep evaluation off training and training off savegrad's holdout, and
    whether that holdout was known."""
    return {
        "prompts_removed_for_overlap": prep.removed,
        "exclude_run": cfg.exclude_run
        or "not given: training prompts were not checked against a savegrad run's holdout",
    }


def add_step_accuracy(trainer: DistillTrainer, measure, every: int) -> None:
    """Accuracy while training. Not under FSDP: every rank generates for its own share of prompts, and
    sharded layers, whose every forward is a collective, would wait on ranks that have stopped."""
    if trainer.is_fsdp_enabled:
        print0("eval_steps is skipped under parallelism fsdp; the accuracy after training is still measured")
        return
    trainer.add_callback(
        StepAccuracy(lambda model: measure(trainer.accelerator.unwrap_model(model)), every, trainer.log)
    )


def trained_student(trainer: DistillTrainer, saved: Path):
    """The student to evaluate after training. A sharded one is replaced by the saved full model on
    every rank: each rank generates for its own share of prompts, so sharded layers, whose every
    forward is a collective, would wait on ranks that have stopped."""
    if not trainer.is_fsdp_enabled:
        # Without accelerate's autocast wrapper: `sharded_accuracy` applies the one precision of the run.
        return trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    trainer.accelerator.wait_for_everyone()  # rank 0 has written model/
    return load_model(str(saved), torch.float32, trainer.args.device)


def truncate_metrics(run: RunDir, step: int) -> None:
    """Drop records logged after `step`, the checkpoint a resumed run continues from (0: none), so the log
    has each step once."""
    if run.writer:
        for name in ("metrics.jsonl", "samples.jsonl"):
            kept = [r for r in run.read_jsonl(name) if r.get("step", 0) <= step]
            (run.path / name).write_text("".join(json.dumps(r) + "\n" for r in kept))


def run(
    mode: str = "tiny",
    overrides: dict | None = None,
    prepared: Prepared | None = None,
    callbacks: list | None = None,
) -> RunDir | None:
    """Prepare, show the memory plan, stop there under `dry_run` (None; in a notebook kernel `PlanOnly`) or
    when the plan does not fit (ConfigError, before any weight is loaded); else create the run directory
    (plan.json in it) and launch the processes; returns the run directory.

    `callbacks` (transformers `TrainerCallback`s) are handed to the trainer in every process."""
    prep = prepared or prepare(mode, overrides)
    if prepared is None:  # a notebook has shown it already
        print0(prep.first_prompt)
    print0(prep.plan.table())
    if prep.cfg.dry_run:
        live.stop_after_plan(JOB)
        return None
    prep.plan.check()
    return start_run(
        process, prep.cfg, JOB, mode, prep, callbacks, files={memory.PLAN_FILE: prep.plan.to_json()}
    )


def main(argv: list[str] | None = None) -> None:
    from opdkit.jobs.whitebox import report

    run_from_cli(
        WhiteboxConfig, "White-box on-policy distillation (opdkit whitebox).", run, report.figures, argv
    )


if __name__ == "__main__":
    main()
