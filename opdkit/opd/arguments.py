"""On-policy distillation's settings, declared once (in `opdkit.settings`, torch-free): `OPDSettings` (the
divergence, the student's rollouts, what is logged) and `OPDTraining` (optimizer, schedule, batches, clipping,
parallelism, checkpoints: TrainingArguments' own names where they mean the same), composed into 02's
`WhiteboxConfig` and 04's (its on-policy attackers); `OPDArguments`, `TrainingArguments` plus `OPDSettings`,
which `DistillTrainer` reads from `self.args`.

    args = OPDArguments(output_dir="runs/x", beta=1.0, rollout_max_new_tokens=1024, rollout_engine="vllm")
    args = training_arguments(cfg, "runs/x/checkpoints", run_name="whitebox/x")    # from a job's config
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import TrainingArguments

from opdkit import memory
from opdkit.config import check_ranges, setting
from opdkit.models import checkpointing_argument, load_tokenizer
from opdkit.opd import crossteacher
from opdkit.run import sharding, tracking
from opdkit.run.launch import launched_world_size
from opdkit.settings import OPDSettings, parse_teachers, parse_weights
from opdkit.tasks.evaluate import evaluation_tokens


@dataclass
class OPDArguments(OPDSettings, TrainingArguments):
    """`TrainingArguments` plus on-policy distillation's own settings, as TRL's `GKDConfig` extends its
    `SFTConfig`. Each rollout row is seeded by (`seed`, step, its place in the step's global batch), not by
    process: the number of processes does not change what is sampled."""

    vllm_max_model_len: int = setting(
        0, "vllm: longest prompt plus completion; 0 means the model's own limit", min=0
    )

    def __post_init__(self):
        TrainingArguments.__post_init__(self)
        own = tuple(f for f in fields(self) if f.name in _OWN)
        check_ranges(self, own)

    @classmethod
    def from_config(cls, cfg: Any, **explicit: Any) -> OPDArguments:
        """Arguments from a job's config: every field the two share by name, then `explicit` (the fields a
        job translates, e.g. `max_grad_norm` 0 meaning never clip)."""
        names = {f.name for f in fields(cls) if f.init}
        shared = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in names}
        return cls(**{**shared, **explicit})


_OWN = {f.name for f in fields(OPDSettings)} | {"vllm_max_model_len"}


def training_arguments(cfg: Any, output_dir: str, run_name: str, **explicit: Any) -> OPDArguments:
    """A job's `OPDSettings` and `OPDTraining` as the trainer's arguments: every field the config shares with
    `OPDArguments` by name, the few a job's settings translate (max_grad_norm 0 means never clip,
    checkpoint_every as save_steps, 0 only at the end, global_batch_size's accumulation), the kit's fixed
    choices (a NaN loss is logged as it is, accuracy is measured by the job, one data loader process), then
    `explicit`."""
    world = launched_world_size()
    return OPDArguments.from_config(
        cfg,
        **{
            "output_dir": output_dir,
            "remove_unused_columns": False,
            "warmup_steps": cfg.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio
            "optim_args": cfg.optim_args or None,
            "max_grad_norm": cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"),
            **checkpointing_argument(cfg.gradient_checkpointing),
            "gradient_accumulation_steps": cfg.accumulation_steps(world),
            "data_seed": cfg.seed,
            "logging_first_step": True,
            "logging_nan_inf_filter": False,  # a NaN loss must show, not be replaced by the running mean
            "save_strategy": "steps",
            "save_steps": cfg.checkpoint_every if cfg.checkpoint_every > 0 else 10**9,
            "project": tracking.PROJECT,  # trackio's project; wandb takes WANDB_PROJECT
            "run_name": run_name,
            "ddp_find_unused_parameters": False,
            "dataloader_num_workers": 0,
            "use_cpu": not torch.cuda.is_available(),
            "disable_tqdm": int(os.environ.get("RANK", "0")) != 0,
            **sharding.fsdp_arguments(cfg.parallelism, world),
            **explicit,
        },
    )


def distill_stage(cfg: Any, world: int, budget: float | None) -> memory.Stage:
    """What one `DistillTrainer` process holds, for the memory plan, from a config with `OPDSettings`,
    `OPDTraining`, the models', precision and evaluation settings: the fp32 student (bf16 autocast), its
    optimizer, the teacher (sharded under fsdp with several processes), every prompt of an optimizer step
    sampled at once (the kit's loop) or the vLLM engine's share, and the greedy evaluation of the teacher
    and of the student (the student's in the engine with vLLM); with a `teacher_server`, the teacher's head
    and received states only, and the student's evaluation; with `teachers`, every one of them, and the
    student's evaluation. A teacher with another tokenizer reads its own token count (`token_ratio`). With
    `rollout_ahead`, a producer process samples instead, where `rollout_device` puts it (`producer_place`).
    Planned for a GPU when there is a budget."""
    dtype = "bfloat16" if cfg.bf16 else "float32"
    served = bool(getattr(cfg, "teacher_server", ""))  # 04's attackers have no served teacher
    specs = parse_teachers(getattr(cfg, "teachers", ""))  # 04's attackers have no set either
    shape = memory.ModelShape.from_config
    unevaluated = served or bool(specs)  # a served teacher or a set: no teacher evaluated here
    ratio = None if specs else teacher_token_ratio(cfg)  # a set shares the student's tokenizer
    return memory.Stage(
        student=shape(cfg.student_model),
        teacher=shape(specs[0].model if specs else cfg.teacher_model),
        student_dtype="float32",
        teacher_dtype=dtype,
        bf16=cfg.bf16,
        device="cpu" if budget is None else "cuda",
        optimizer=memory.optimizer_kind(cfg.optim, cfg.optim_args),
        parallelism=cfg.parallelism,
        world_size=world,
        shard_teacher=True,  # DistillTrainer shards the teacher too under fsdp with several processes
        gradient_checkpointing=cfg.gradient_checkpointing,
        prompt_len=cfg.max_prompt_length,
        completion_len=OPDSettings.episode_tokens(cfg),  # a multi-turn episode at its longest
        train_batch_size=cfg.per_device_train_batch_size,
        loss_chunk_size=cfg.loss_chunk_size,
        sampled_rows=cfg.per_device_train_batch_size * cfg.accumulation_steps(world),
        eval_model="student" if unevaluated else "teacher",
        eval_student=not unevaluated and cfg.rollout_engine == "hf",
        eval_batch_size=cfg.eval_batch_size if cfg.eval_size else 0,
        eval_completion_len=evaluation_tokens(cfg),  # with an environment, a greedy episode at its longest
        rollout_engine=cfg.rollout_engine,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_sleep=cfg.vllm_sleep,
        engine_dtype=dtype,
        sync_streamed=True,  # VLLMEngine.sync hands the weights over one tensor at a time
        teacher_served=served or bool(specs and specs[0].server),
        served_dtype=getattr(cfg, "teacher_server_dtype", "bfloat16"),
        cross_tokenizer=ratio is not None,
        teacher_token_ratio=ratio or 1.0,
        other_teachers=tuple(memory.OtherTeacher(shape(t.model), bool(t.server)) for t in specs[1:]),
        teachers_routed=bool(specs) and not parse_weights(getattr(cfg, "teacher_weights", "")),
        rollout_ahead=getattr(cfg, "rollout_ahead", 0),
        producer_place=producer_place(getattr(cfg, "rollout_device", ""), budget),
    )


def producer_place(rollout_device: str, budget: float | None) -> str:
    """Where `rollout_device` puts the rollout producer for the memory plan (`memory.Stage.producer_place`):
    beside the trainer (empty, the trainer's device: cuda or cuda:0 in its one process, cpu on a CPU), on a
    GPU of its own (cuda:N, N >= 1), or on the CPU beside a GPU trainer."""
    if rollout_device in ("", "cuda", "cuda:0") or (rollout_device == "cpu" and budget is None):
        return "beside"
    return "cpu" if rollout_device == "cpu" else "gpu"


def teacher_token_ratio(cfg: Any) -> float | None:
    """With a teacher of another tokenizer, its tokens per student token (`memory.token_ratio`, at least 1);
    None when the teacher reads the student's tokens."""
    if not cross_tokenizer(cfg):
        return None
    return memory.token_ratio(load_tokenizer(cfg.student_model), load_tokenizer(cfg.teacher_model))


def cross_tokenizer(cfg: Any) -> bool:
    """Whether the config's teacher reads another tokenizer than its student (`opd.crossteacher`)."""
    if cfg.teacher_model == cfg.student_model:
        return False
    return crossteacher.differ(load_tokenizer(cfg.student_model), load_tokenizer(cfg.teacher_model))
