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

from opdkit.config import check_ranges
from opdkit.models import checkpointing_argument
from opdkit.run import sharding, tracking
from opdkit.run.launch import launched_world_size
from opdkit.settings import EngineContextSettings, OPDSettings


@dataclass
class OPDArguments(OPDSettings, EngineContextSettings, TrainingArguments):
    """`TrainingArguments` plus on-policy distillation's own settings, as TRL's `GKDConfig` extends its
    `SFTConfig`, checked when made (ranges, then what the settings need of each other). Each rollout row is
    seeded by (`seed`, step, its place in the step's global batch), not by process: the number of processes
    does not change what is sampled."""

    def __post_init__(self):
        TrainingArguments.__post_init__(self)
        own = tuple(f for f in fields(self) if f.name in _OWN)
        check_ranges(self, own)
        OPDSettings.normalise(self)

    @classmethod
    def from_config(cls, cfg: Any, **explicit: Any) -> OPDArguments:
        """Arguments from a job's config: every field the two share by name, then `explicit` (the fields a
        job translates, e.g. `max_grad_norm` 0 meaning never clip)."""
        names = {f.name for f in fields(cls) if f.init}
        shared = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in names}
        return cls(**{**shared, **explicit})


_OWN = {f.name for f in fields(OPDSettings)} | {f.name for f in fields(EngineContextSettings)}


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
