"""Configuration: one dataclass per notebook's job, one source of truth per parameter.

    cfg = load_config("02_whitebox", mode="tiny", overrides={"learning_rate": 1e-3})

Every field carries `help` text and is range-checked in `__post_init__`. Presets live in
`opdkit/params/<notebook>/<mode>.yaml` (keys are field names; `extends: <mode>` inherits another preset).
Unknown modes and unknown keys stop the run before anything is written, with an error that names the
offender and lists what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from opdkit.ads_config import AntidistillationConfig
from opdkit.fields import ConfigError, RunFields, _f

# Presets ship inside the package (package data), so a plain `pip install .` finds them too.
PARAMS_DIR = Path(str(resources.files("opdkit") / "params"))


@dataclass
class WhiteboxConfig(RunFields):
    """White-box on-policy distillation (02_whitebox); field names follow the original DistillConfig."""

    student_model: str = _f("tiny:student", "student: a local HF folder, a hub name, or tiny:student")
    teacher_model: str = _f(
        "tiny:teacher", "teacher sharing the student's tokenizer: folder, hub name, or tiny:teacher"
    )
    dataset_path: str = _f(
        "tiny", "prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name"
    )
    dataset_split: str = _f("train", "split to read from a datasets folder or hub dataset")
    subset_size: int = _f(1000, "prompts used, a deterministic subset by seed; -1 means all", min=-1)
    eval_size: int = _f(500, "held-out problems for accuracy before and after; 0 skips evaluation", min=0)
    eval_max_new_tokens: int = _f(0, "completion budget when evaluating; 0 means max_new_tokens", min=0)
    eval_batch_size: int = _f(64, "prompts per greedy evaluation batch per process (KV cache memory)", min=1)
    eval_steps: int = _f(
        0, "also measure greedy accuracy every this many optimizer steps while training; 0 never", min=0
    )
    eval_steps_size: int = _f(
        100, "held-out problems measured every eval_steps: the first of the eval_size set", min=1
    )
    max_prompt_length: int = _f(1024, "longer prompts are dropped (and counted)", min=1)
    max_new_tokens: int = _f(1024, "completion length the student samples", min=1)
    enable_thinking: bool = _f(False, "passed to the chat template (Qwen3 thinking mode)")
    beta: float = _f(
        1.0, "generalized JSD weight: 0 forward KL, 1 reverse KL(student||teacher)", min=0.0, max=1.0
    )
    kl_temperature: float = _f(1.0, "temperature both distributions are compared at", min=1e-3)
    gen_temperature: float = _f(1.0, "sampling temperature of the student's rollouts", min=1e-3)
    gen_top_p: float = _f(
        1.0, "nucleus of the student's rollouts; 1.0 samples the full distribution", min=1e-3, max=1.0
    )
    learning_rate: float = _f(1e-6, "peak learning rate (AdamW)", min=0.0)
    lr_scheduler_type: str = _f("constant", "transformers scheduler name: constant, linear, cosine, ...")
    warmup_ratio: float = _f(0.0, "fraction of steps spent warming up", min=0.0, max=0.999)
    optim: str = _f(
        "adamw_torch_fused",
        "optimizer, a transformers `optim` name: adamw_torch_fused (TrainingArguments default, the "
        "original), sgd, ...",
    )
    optim_args: str = _f("", "extra optimizer arguments, e.g. momentum=0.9 for sgd")
    weight_decay: float = _f(0.0, "AdamW weight decay", min=0.0)
    adam_beta2: float = _f(0.999, "AdamW beta2", min=0.0, max=1.0)
    per_device_train_batch_size: int = _f(4, "prompts per process per micro-batch", min=1)
    gradient_accumulation_steps: int = _f(4, "micro-batches per optimizer step", min=1)
    num_train_epochs: float = _f(1.0, "passes over the prompts (ignored when max_steps > 0)", min=0.0)
    max_steps: int = _f(-1, "optimizer steps; -1 means num_train_epochs", min=-1)
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this; 0 turns clipping off", min=0.0)
    bf16: bool = _f(False, "bf16 mixed precision for the student, bf16 weights for the teacher (GPU)")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    parallelism: str = _f(
        "ddp",
        "how several processes hold the student: ddp replicates it; fsdp shards it with FSDP2 (accelerate), "
        "for students too big to replicate; one process ignores it. The frozen teacher is always replicated",
        choices=("ddp", "fsdp"),
    )
    loss_chunk_size: int = _f(1024, "completion tokens per chunk of the divergence", min=1)
    rollout_engine: str = _f(
        "hf",
        "what samples the student's rollouts, all of an optimizer step's prompts in one call: hf, the kit's "
        "KV-cached loop; vllm, a vLLM engine colocated in every process (install the vllm extra), synced "
        "with the student once per step",
        choices=("hf", "vllm"),
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3,
        "rollout_engine vllm: share of each GPU's memory the engine reserves for weights and KV cache, "
        "beside the training (on CPU: the share of RAM given to its KV cache)",
        min=0.01,
        max=1.0,
    )
    vllm_sleep: bool = _f(
        False,
        "rollout_engine vllm: free the engine's GPU memory (weights and KV cache, vLLM sleep level 2) "
        "between rollouts, for the training's forward and backward; the next weight sync brings it back. "
        "CUDA only",
    )
    logging_steps: int = _f(1, "log metrics every this many optimizer steps", min=1)
    sample_every: int = _f(
        10, "write a few sampled completions to samples.jsonl every this many steps; 0 never", min=0
    )
    save_rollouts: bool = _f(
        False, "keep every step's prompts and completions in rollouts/ (token ids, per process)"
    )
    save_steps: int = _f(100, "checkpoint every this many steps; 0 only at the end", min=0)
    save_total_limit: int = _f(2, "checkpoints kept", min=1)


@dataclass
class SaveGradConfig(RunFields):
    """Proxy-student gradient for antidistillation sampling (01_save_grad)."""

    teacher_model: str = _f(
        "tiny:teacher", "teacher that writes the holdout traces: folder, hub name, or tiny:teacher"
    )
    proxy_model: str = _f(
        "tiny:student", "proxy student whose gradient is saved: folder, hub name, or tiny:student"
    )
    dataset_path: str = _f(
        "tiny",
        "holdout prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name",
    )
    dataset_split: str = _f("train", "split to read from a datasets folder or hub dataset")
    holdout_fraction: float = _f(
        1.0,
        "the holdout is this fraction of the dataset, its tail after a shuffle by seed (tiny: its own "
        "problem stream)",
        min=0.0,
        max=1.0,
    )
    subset_size: int = _f(256, "holdout prompts used, the first of the holdout; -1 means all", min=-1)
    system_prompt: str = _f("", "system message put before every holdout prompt; empty for none")
    traces_path: str = _f("", "existing traces (a datasets folder or data file) instead of generating them")
    trace_column: str = _f(
        "messages",
        "column of traces_path: chat messages ending with the assistant's answer, or the answer text next "
        "to a prompt column",
    )
    max_prompt_length: int = _f(512, "longer holdout prompts are dropped (and counted)", min=1)
    max_new_tokens: int = _f(512, "trace length budget: tokens the teacher writes at most", min=1)
    max_length: int = _f(
        0, "cap on prompt plus trace tokens, as the ADS pipeline's max_length; 0 means no cap", min=0
    )
    enable_thinking: bool = _f(False, "passed to the chat templates (Qwen3 thinking mode)")
    gen_temperature: float = _f(0.0, "teacher sampling temperature for the traces; 0 is greedy", min=0.0)
    gen_top_p: float = _f(1.0, "nucleus of the teacher's sampling (unused when greedy)", min=1e-3, max=1.0)
    gen_batch_size: int = _f(64, "prompts per generation batch, per process", min=1)
    rollout_engine: str = _f(
        "hf",
        "what writes the teacher's traces: hf, the kit's KV-cached loop; vllm, a vLLM engine in every "
        "process (install the vllm extra)",
        choices=("hf", "vllm"),
    )
    vllm_gpu_memory_utilization: float = _f(
        0.5,
        "rollout_engine vllm: share of each GPU's memory the engine reserves (on CPU: the share of RAM for "
        "its KV cache)",
        min=0.01,
        max=1.0,
    )
    proxy_tokens: str = _f(
        "proxy",
        "what the proxy reads: proxy, each trace re-rendered in the proxy's chat template; teacher, the "
        "teacher's own prompt and completion token ids (as the ADS reference, and as ADS feeds the proxy "
        "later)",
        choices=("proxy", "teacher"),
    )
    normalization: str = _f(
        "trace",
        "trace: mean over traces of each trace's mean-token gradient; token: mean over all completion tokens",
        choices=("trace", "token"),
    )
    batch_size: int = _f(8, "traces per backward pass, per process (the result does not depend on it)", min=1)
    bf16: bool = _f(False, "bf16 teacher for generation (GPU); the proxy always runs in fp32")


@dataclass
class ClipLessonConfig(RunFields):
    """Clip versus no-clip (03_clip_vs_noclip): arms built from 02_whitebox presets or runs."""

    clip_mode: str = _f("tiny", "02_whitebox preset of the clipped arm (the original: sanity)")
    noclip_mode: str = _f("tiny-noclip", "02_whitebox preset of the unclipped arm (the original: noclip)")
    clip_run: str = _f("", "an existing 02_whitebox run directory to use as the clipped arm")
    noclip_run: str = _f("", "an existing 02_whitebox run directory to use as the unclipped arm")
    ablations: bool = _f(
        True, "also run clip at the noclip learning rate and noclip at the clip learning rate"
    )
    sgd_arms: bool = _f(
        False, "also run clip and noclip with SGD and momentum, an optimizer that does not bound its own step"
    )
    sgd_lr: float = _f(0.05, "learning rate of both SGD arms", min=0.0)
    sgd_momentum: float = _f(0.9, "momentum of both SGD arms", min=0.0, max=1.0)
    seeds: str = _f("42", "comma-separated seeds; every arm runs once per seed")
    max_steps: int = _f(0, "optimizer steps of every arm; 0 keeps each preset's", min=0)
    eval_size: int = _f(-1, "held-out problems per accuracy measurement; -1 keeps each preset's", min=-1)


JOBS: dict[str, type[RunFields]] = {
    "01_save_grad": SaveGradConfig,
    "02_whitebox": WhiteboxConfig,
    "03_clip_vs_noclip": ClipLessonConfig,
    "04_antidistill": AntidistillationConfig,
}
DEFAULT_MODE = "tiny"
NOTEBOOK_ONLY = {"mode"}  # notebook parameters that are not config fields


def field_names(job: str) -> list[str]:
    return [f.name for f in fields(job_class(job))]


def job_class(job: str) -> type[RunFields]:
    if job not in JOBS:
        raise ConfigError(f"unknown job {job!r}; valid: {sorted(JOBS)}.")
    return JOBS[job]


def available_modes(job: str, params_dir: Path = PARAMS_DIR) -> list[str]:
    return sorted(p.stem for p in (params_dir / job).glob("*.yaml"))


def load_preset(job: str, mode: str, params_dir: Path = PARAMS_DIR, _seen: tuple = ()) -> dict:
    """The preset's keys with `extends` chains resolved (the child wins)."""
    path = params_dir / job / f"{mode}.yaml"
    if not path.is_file():
        modes = available_modes(job, params_dir)
        raise ConfigError(f"unknown mode {mode!r} for {job}; valid modes: {', '.join(modes)}.")
    if mode in _seen:
        raise ConfigError(f"preset {path} extends itself through {' -> '.join(_seen + (mode,))}.")
    data = yaml.safe_load(path.read_text()) or {}
    parent = data.pop("extends", None)
    base = load_preset(job, parent, params_dir, _seen + (mode,)) if parent else {}
    _check_keys(job, data, f"preset {path}")
    return {**base, **data}


def _check_keys(job: str, keys: dict | set, where: str) -> None:
    valid = field_names(job)
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown parameter {key!r} in {where}.{hint} Valid: {', '.join(valid)}.")


def load_config(
    job: str, mode: str = DEFAULT_MODE, overrides: dict | None = None, params_dir: Path = PARAMS_DIR
):
    """Resolve `mode`'s preset, apply `overrides` (None values are ignored), validate, return the
    dataclass."""
    values = load_preset(job, mode, params_dir)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    _check_keys(job, overrides, "the parameters")
    values.update(overrides)
    cls = job_class(job)
    types = {f.name: f.type for f in fields(cls)}
    return cls(**{k: _coerce(k, v, types[k]) for k, v in values.items()})


def _coerce(name: str, value: Any, type_: str) -> Any:
    """papermill and YAML hand over ints for floats and strings for numbers; make them the field's type."""
    try:
        if type_ == "float" and not isinstance(value, bool):
            return float(value)
        if type_ == "int" and not isinstance(value, bool) and float(value) == int(float(value)):
            return int(float(value))
        if type_ == "bool" and isinstance(value, str):
            return {"true": True, "false": False}[value.lower()]
        if type_ == "str" and isinstance(value, (int, float)):
            return str(value)
    except (ValueError, KeyError):
        raise ConfigError(f"{name}={value!r} is not a valid {type_}.") from None
    return value


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def help_text(job: str) -> str:
    """One line per field: name, default, help; what `papermill --help-notebook` cannot show in full."""
    lines = []
    for f in fields(job_class(job)):
        lines.append(f"  {f.name:28s} {f.default!r:>16}  {f.metadata['help']}")
    return "\n".join(lines)
