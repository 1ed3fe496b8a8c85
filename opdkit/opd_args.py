"""`OPDArguments`: `TrainingArguments` plus on-policy distillation's own settings.

args = OPDArguments(output_dir="runs/x", beta=1.0, max_new_tokens=1024, rollout_engine="vllm")
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from opdkit import engines


def _arg(default, help: str, **range_):
    return field(default=default, metadata={"help": help, **range_})


@dataclass
class OPDArguments(TrainingArguments):
    """`TrainingArguments` plus on-policy distillation's own settings, as TRL's `GKDConfig` extends its
    `SFTConfig`; `DistillTrainer` reads them from `self.args`. Rollouts are seeded by (`seed`, step, rank)."""

    beta: float = _arg(
        1.0, "generalized JSD weight: 0 forward KL, 1 reverse KL(student||teacher)", min=0.0, max=1.0
    )
    kl_temperature: float = _arg(1.0, "temperature both distributions are compared at", min=1e-3)
    gen_temperature: float = _arg(1.0, "sampling temperature of the student's rollouts", min=1e-3)
    gen_top_p: float = _arg(
        1.0, "nucleus of the student's rollouts; 1.0 samples the full distribution", min=1e-3, max=1.0
    )
    max_new_tokens: int = _arg(128, "completion length the student samples", min=1)
    loss_chunk_size: int = _arg(1024, "completion tokens per chunk of the divergence", min=1)
    sample_every: int = _arg(0, "log a few sampled completions every this many steps; 0 never", min=0)
    samples_per_log: int = _arg(4, "completions logged each time", min=1)
    save_rollouts: bool = _arg(
        False, "keep every step's prompts and completions in rollouts/ (token ids, per process)"
    )
    rollout_engine: str = _arg(
        "hf",
        "what samples the rollouts: hf, the kit's KV-cached loop; vllm, a vLLM engine colocated in every "
        "process, synced with the student once per optimizer step",
        choices=engines.ENGINES,
    )
    vllm_gpu_memory_utilization: float = _arg(
        0.3,
        "vllm: share of the device's memory the engine reserves for weights and KV cache (on CPU: the share "
        "of RAM for its KV cache)",
        min=0.01,
        max=1.0,
    )
    vllm_sleep: bool = _arg(
        False, "vllm: free the engine's GPU memory between rollouts (sleep level 2); CUDA only"
    )
    vllm_max_model_len: int = _arg(
        0, "vllm: longest prompt plus completion; 0 means the model's own limit", min=0
    )

    def __post_init__(self):
        super().__post_init__()
        for name in (
            "beta",
            "kl_temperature",
            "gen_temperature",
            "gen_top_p",
            "max_new_tokens",
            "loss_chunk_size",
            "sample_every",
            "samples_per_log",
            "vllm_gpu_memory_utilization",
            "vllm_max_model_len",
        ):
            meta, value = self.__dataclass_fields__[name].metadata, getattr(self, name)
            if ("min" in meta and value < meta["min"]) or ("max" in meta and value > meta["max"]):
                raise ValueError(
                    f"{name}={value!r} is outside [{meta.get('min')}, {meta.get('max')}] ({meta['help']})."
                )
        if self.rollout_engine not in engines.ENGINES:
            raise ValueError(f"rollout_engine={self.rollout_engine!r} is not one of {list(engines.ENGINES)}.")
