"""On-policy distillation's settings, declared once: `OPDSettings` (mixed into 02's `WhiteboxConfig`) and
`OPDArguments`, `TrainingArguments` plus those settings, which `DistillTrainer` reads from `self.args`.

    args = OPDArguments(output_dir="runs/x", beta=1.0, max_new_tokens=1024, rollout_engine="vllm")
    args = OPDArguments.from_config(cfg, output_dir=...)   # every field cfg shares with it, by name
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from transformers import TrainingArguments

from opdkit.config import check_ranges, setting
from opdkit.rollout.engines import EngineSettings


@dataclass
class OPDSettings(EngineSettings):
    """The distillation's own settings: the divergence, the student's sampling, what is logged."""

    beta: float = setting(
        1.0, "generalized JSD weight: 0 forward KL, 1 reverse KL(student||teacher)", min=0.0, max=1.0
    )
    kl_temperature: float = setting(1.0, "temperature both distributions are compared at", min=1e-3)
    gen_temperature: float = setting(1.0, "sampling temperature of the student's rollouts", min=1e-3)
    gen_top_p: float = setting(
        1.0, "nucleus of the student's rollouts; 1.0 samples the full distribution", min=1e-3, max=1.0
    )
    max_new_tokens: int = setting(1024, "completion length the student samples", min=1)
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
class OPDArguments(OPDSettings, TrainingArguments):
    """`TrainingArguments` plus on-policy distillation's own settings, as TRL's `GKDConfig` extends its
    `SFTConfig`. Rollouts are seeded by (`seed`, step, rank)."""

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
