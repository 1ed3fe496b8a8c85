"""On-policy distillation's settings, declared once: `OPDSettings` (the divergence, the student's rollouts,
what is logged) and `OPDTraining` (optimizer, schedule, batches, clipping, parallelism, checkpoints:
TrainingArguments' own names), composed into 02's `WhiteboxConfig` and 04's (its on-policy attackers);
`OPDArguments`, `TrainingArguments` plus `OPDSettings`, which `DistillTrainer` reads from `self.args`.

    args = OPDArguments(output_dir="runs/x", beta=1.0, max_new_tokens=1024, rollout_engine="vllm")
    args = training_arguments(cfg, "runs/x/checkpoints", run_name="whitebox/x")    # from a job's config
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch
from transformers import TrainingArguments

from opdkit import memory
from opdkit.config import ConfigError, check_ranges, setting
from opdkit.models import checkpointing_argument, load_tokenizer
from opdkit.opd import crossteacher
from opdkit.opd.crosstok import CrossTokenizerSettings
from opdkit.rollout.engines import EngineSettings
from opdkit.run import sharding, tracking
from opdkit.run.launch import launched_world_size


@dataclass
class OPDSettings(EngineSettings, CrossTokenizerSettings):
    """The distillation's own settings: the divergence, the student's sampling, what is logged; with a
    teacher whose tokenizer differs from the student's, the cross-tokenizer loss's (`crosstok_*`)."""

    beta: float = setting(
        1.0, "generalized JSD weight: 0 forward KL, 1 reverse KL(student||teacher)", min=0.0, max=1.0
    )
    kl_temperature: float = setting(1.0, "temperature both distributions are compared at", min=1e-3)
    gen_temperature: float = setting(1.0, "sampling temperature of the student's rollouts", min=1e-3)
    gen_top_p: float = setting(
        1.0, "nucleus of the student's rollouts; 1.0 samples the full distribution", min=1e-3, max=1.0
    )
    loss_chunk_size: int = setting(1024, "completion tokens per chunk of the divergence", min=1)
    sample_every: int = setting(
        10, "write a few sampled completions to samples.jsonl every this many steps; 0 never", min=0
    )
    samples_per_log: int = setting(4, "completions written each time", min=1)
    save_rollouts: bool = setting(
        False, "keep every step's prompts and completions in rollouts/ (token ids, per process)"
    )
    vllm_sleep: bool = setting(
        False,
        "rollout_engine vllm: free the engine's GPU memory (weights and KV cache, vLLM sleep level 2) "
        "between rollouts, for the training's forward and backward; the next weight sync brings it back. "
        "CUDA only",
    )


@dataclass
class OPDTraining:
    """How on-policy distillation trains, under TrainingArguments' own names (`training_arguments` maps
    them)."""

    learning_rate: float = setting(1e-6, "peak learning rate (AdamW)", min=0.0)
    lr_scheduler_type: str = setting("constant", "transformers scheduler name: constant, linear, cosine, ...")
    warmup_ratio: float = setting(0.0, "fraction of steps spent warming up", min=0.0, max=0.999)
    optim: str = setting(
        "adamw_torch_fused",
        "optimizer, a transformers `optim` name: adamw_torch_fused (TrainingArguments default, the "
        "original), sgd, ...",
    )
    optim_args: str = setting("", "extra optimizer arguments, e.g. momentum=0.9 for sgd")
    weight_decay: float = setting(0.0, "AdamW weight decay", min=0.0)
    adam_beta2: float = setting(0.999, "AdamW beta2", min=0.0, max=1.0)
    per_device_train_batch_size: int = setting(4, "prompts per process per micro-batch", min=1)
    global_batch_size: int = setting(
        0,
        "prompts per optimizer step over all processes, whatever their number; the micro-batches each "
        "process accumulates are derived: global_batch_size / (per_device_train_batch_size x processes). "
        "0 means one micro-batch per process",
        min=0,
    )
    num_train_epochs: float = setting(1.0, "passes over the prompts (ignored when max_steps > 0)", min=0.0)
    max_steps: int = setting(-1, "optimizer steps; -1 means num_train_epochs", min=-1)
    max_grad_norm: float = setting(
        1.0, "clip the global gradient norm to this; 0 turns clipping off", min=0.0
    )
    parallelism: str = setting(
        "ddp",
        "how several processes hold the models: ddp replicates them; fsdp shards the student with FSDP2 "
        "(accelerate) and the frozen teacher too (weights only), for models too big to replicate; one "
        "process ignores it",
        choices=("ddp", "fsdp"),
    )
    logging_steps: int = setting(1, "log metrics every this many optimizer steps", min=1)
    save_steps: int = setting(100, "checkpoint every this many steps; 0 only at the end", min=0)
    save_total_limit: int = setting(2, "checkpoints kept", min=1)

    def accumulation_steps(self, processes: int) -> int:
        """Micro-batches each process accumulates per optimizer step, so that a step takes
        `global_batch_size` prompts over `processes` processes."""
        per_device, total = self.per_device_train_batch_size, self.global_batch_size
        if not total:
            return 1
        if total % (per_device * processes):
            fits = [n for n in range(1, per_device + 1) if total % (n * processes) == 0]
            hint = f" or per_device_train_batch_size={max(fits)}," if fits else ""
            raise ConfigError(
                f"global_batch_size={total} prompts per optimizer step do not split into micro-batches of "
                f"per_device_train_batch_size={per_device} on {processes} process(es), "
                f"{per_device * processes} prompts a round; set global_batch_size to a multiple of "
                f"{per_device * processes},{hint} or change the number of processes (num_processes)."
            )
        return total // (per_device * processes)


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
    `OPDArguments` by name, the few a job's settings translate (max_grad_norm 0 means never clip, save_steps 0
    only at the end, global_batch_size's accumulation), the kit's fixed choices (a NaN loss is logged as it
    is, accuracy is measured by the job, one data loader process), then `explicit`."""
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
            "eval_steps": None,  # the job measures accuracy (StepAccuracy), not through Trainer.evaluate
            "save_strategy": "steps",
            "save_steps": cfg.save_steps if cfg.save_steps > 0 else 10**9,
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
    sampled at once (the kit's loop) or the vLLM engine's share, and the greedy evaluation of the teacher;
    with a `teacher_server`, the teacher's head and received states only, and the student's evaluation.
    Planned for a GPU when there is a budget."""
    dtype = "bfloat16" if cfg.bf16 else "float32"
    served = bool(getattr(cfg, "teacher_server", ""))  # 04's attackers have no served teacher
    return memory.Stage(
        student=memory.ModelShape.from_config(cfg.student_model),
        teacher=memory.ModelShape.from_config(cfg.teacher_model),
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
        completion_len=cfg.max_new_tokens,
        train_batch_size=cfg.per_device_train_batch_size,
        loss_chunk_size=cfg.loss_chunk_size,
        gen_batch_size=cfg.per_device_train_batch_size * cfg.accumulation_steps(world),
        eval_model="student" if served else "teacher",
        eval_batch_size=cfg.eval_batch_size if cfg.eval_size else 0,
        eval_completion_len=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        rollout_engine=cfg.rollout_engine,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_sleep=cfg.vllm_sleep,
        engine_dtype=dtype,
        sync_streamed=True,  # VLLMEngine.sync hands the weights over one tensor at a time
        teacher_served=served,
        served_dtype=getattr(cfg, "teacher_server_dtype", "bfloat16"),
        cross_tokenizer=cross_tokenizer(cfg),
    )


def cross_tokenizer(cfg: Any) -> bool:
    """Whether the config's teacher reads another tokenizer than its student (`opd.crossteacher`)."""
    if cfg.teacher_model == cfg.student_model:
        return False
    return crossteacher.differ(load_tokenizer(cfg.student_model), load_tokenizer(cfg.teacher_model))
