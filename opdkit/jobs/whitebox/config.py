"""whitebox's settings: `WhiteboxConfig`, the original's DistillConfig fields plus `OPDSettings`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import ConfigError, RunFields, setting
from opdkit.opd.arguments import OPDSettings


@dataclass
class WhiteboxConfig(RunFields, OPDSettings):
    """White-box on-policy distillation (notebook 02); field names follow the original DistillConfig. The
    distillation's own settings (beta, temperatures, rollout engine, ...) come from `OPDSettings`, declared
    once for this config and the trainer's `OPDArguments`."""

    job: ClassVar[str] = "whitebox"

    student_model: str = setting("tiny:student", "student: a local HF folder, a hub name, or tiny:student")
    teacher_model: str = setting(
        "tiny:teacher", "teacher sharing the student's tokenizer: folder, hub name, or tiny:teacher"
    )
    dataset_path: str = setting(
        "tiny", "prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name"
    )
    dataset_split: str = setting("train", "split to read from a datasets folder or hub dataset")
    subset_size: int = setting(1000, "prompts used, a deterministic subset by seed; -1 means all", min=-1)
    exclude_run: str = setting(
        "",
        "a savegrad run whose holdout prompts are left out of training (subset_size -1 would take them); "
        "empty: not checked, which the summary says",
    )
    eval_size: int = setting(
        500, "held-out problems for accuracy before and after; 0 skips evaluation", min=0
    )
    eval_max_new_tokens: int = setting(0, "completion budget when evaluating; 0 means max_new_tokens", min=0)
    eval_batch_size: int = setting(
        64, "prompts per greedy evaluation batch per process (KV cache memory)", min=1
    )
    forced_accuracy: bool = setting(
        False,
        "also measure accuracy before and after with each final answer forced, as the ADS reference reports "
        "beside raw accuracy: the task's answer cue appended to each completion, a few greedy tokens more",
    )
    eval_steps: int = setting(
        0, "also measure greedy accuracy every this many optimizer steps while training; 0 never", min=0
    )
    eval_steps_size: int = setting(
        100, "held-out problems measured every eval_steps: the first of the eval_size set", min=1
    )
    max_prompt_length: int = setting(1024, "longer prompts are dropped (and counted)", min=1)
    enable_thinking: bool = setting(False, "passed to the chat template (Qwen3 thinking mode)")
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
    bf16: bool = setting(False, "bf16 mixed precision for the student, bf16 weights for the teacher (GPU)")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward to save memory")
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
