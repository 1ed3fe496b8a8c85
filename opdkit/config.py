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
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

# Presets ship inside the package (package data), so a plain `pip install .` finds them too.
PARAMS_DIR = Path(str(resources.files("opdkit") / "params"))


class ConfigError(ValueError):
    """A preset, mode or parameter that cannot be used; the message says how to fix it."""


def _f(default: Any, help: str, **range_) -> Any:
    return field(default=default, metadata={"help": help, **range_})


@dataclass
class RunFields:
    """Fields every job shares: where it writes and how it treats an existing run directory."""

    run_dir: str = _f("", "where this run writes; empty means a new unique folder under runs/")
    overwrite: bool = _f(False, "replace the contents of a non-empty run_dir")
    resume: bool = _f(False, "continue the run in a non-empty run_dir from its last complete checkpoint")
    seed: int = _f(42, "random seed for data order, sampling and initialisation", min=0)
    num_processes: int = _f(
        0, "processes to launch (one per GPU); 0 means every visible GPU, or 1 on CPU", min=0
    )
    report_to: str = _f(
        "none",
        "experiment tracker that receives the metrics and sample tables: none, tensorboard, trackio "
        "(local-first; pip install opdkit[track]) or wandb",
        choices=("none", "tensorboard", "trackio", "wandb"),
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.overwrite and self.resume:
            raise ConfigError(
                "overwrite and resume are both set; choose one: overwrite=True starts afresh, resume=True continues."
            )


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
        "optimizer, a transformers `optim` name: adamw_torch_fused (TrainingArguments default, the original), sgd, ...",
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
        "KV-cached loop; vllm, a vLLM engine colocated in every process (install the vllm extra), synced with "
        "the student once per step",
        choices=("hf", "vllm"),
    )
    vllm_gpu_memory_utilization: float = _f(
        0.3,
        "rollout_engine vllm: share of each GPU's memory the engine reserves for weights and KV cache, beside "
        "the training (on CPU: the share of RAM given to its KV cache)",
        min=0.01,
        max=1.0,
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
        "the holdout is this fraction of the dataset, its tail after a shuffle by seed (tiny: its own problem stream)",
        min=0.0,
        max=1.0,
    )
    subset_size: int = _f(256, "holdout prompts used, the first of the holdout; -1 means all", min=-1)
    system_prompt: str = _f("", "system message put before every holdout prompt; empty for none")
    traces_path: str = _f("", "existing traces (a datasets folder or data file) instead of generating them")
    trace_column: str = _f(
        "messages",
        "column of traces_path: chat messages ending with the assistant's answer, or the answer text next to a prompt column",
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
    proxy_tokens: str = _f(
        "proxy",
        "what the proxy reads: proxy, each trace re-rendered in the proxy's chat template; teacher, the "
        "teacher's own prompt and completion token ids (as the ADS reference, and as ADS feeds the proxy later)",
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


@dataclass
class AntidistillationConfig(RunFields):
    """Antidistillation sampling and its trade-off (04_antidistill): a λ sweep of ADS beside a temperature
    sweep; at every point the teacher writes traces and a fresh student is distilled on them by SFT."""

    teacher_model: str = _f(
        "tiny:teacher", "teacher that writes the training traces: folder, hub name, or tiny:teacher"
    )
    proxy_model: str = _f(
        "tiny:student", "proxy student the gradient belongs to (shares the teacher's tokenizer)"
    )
    student_model: str = _f(
        "tiny:student",
        "student distilled at every point, afresh each time: folder, hub name, or tiny:student",
    )
    student_tokenizer: str = _f(
        "", "the student's tokenizer (and chat template) if not its own folder's, e.g. an -Instruct sibling"
    )
    student_init: str = _f(
        "pretrained",
        "pretrained: the student's weights; scratch: its architecture, freshly initialised by seed",
        choices=("pretrained", "scratch"),
    )
    grads_run: str = _f(
        "", "a 01_save_grad run directory with grads.safetensors; empty runs 01_save_grad inside this run"
    )
    grads_mode: str = _f(
        "tiny", "01_save_grad preset run when grads_run is empty (with this teacher, proxy and seed)"
    )
    dataset_path: str = _f(
        "tiny",
        "training prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name",
    )
    dataset_split: str = _f("train", "split to read from a datasets folder or hub dataset")
    subset_size: int = _f(
        512,
        "training prompts the teacher answers at every point (the head of the seed-shuffled dataset)",
        min=1,
    )
    system_prompt: str = _f("", "system message put before every prompt; empty for none")
    eval_dataset_path: str = _f(
        "", "evaluation prompts for the distilled students; empty: the tiny held-out problems"
    )
    eval_dataset_split: str = _f("test", "split of eval_dataset_path")
    eval_size: int = _f(
        300,
        "evaluation problems per distilled student (at least 1); -1 means all of eval_dataset_path",
        min=-1,
    )
    max_prompt_length: int = _f(512, "longer prompts are dropped (and counted)", min=1)
    max_new_tokens: int = _f(40, "trace length budget: tokens the teacher writes at most", min=1)
    eval_max_new_tokens: int = _f(
        0, "completion budget of the students' greedy evaluation; 0 means max_new_tokens", min=0
    )
    enable_thinking: bool = _f(False, "passed to the chat templates (Qwen3 thinking mode)")
    lams: list = _f((0.0, 0.05, 0.08, 0.11), "ADS sweep: the λ values, each at every ads_temperatures value")
    answer_lams: list = _f(
        (0.015, 0.03, 0.045),
        "a second ADS sweep whose gradient is the proxy's NLL on the answer tokens only (tiny: after ';', "
        "else from the last \\boxed), computed here from the gradient run's traces; empty skips it",
    )
    ads_temperatures: list = _f((1.0,), "temperatures the ADS sweeps run at")
    temperatures: list = _f(
        (1.0, 1.2, 1.4, 1.6), "baseline sweep: plain temperature sampling (λ 0) at these temperatures"
    )
    top_k: int = _f(
        0,
        "keep the k most likely tokens after the ADS term and the temperature, before top-p; 0 is off "
        "(the ADS reference: 50, transformers' default)",
        min=0,
    )
    top_p: float = _f(
        1.0,
        "nucleus applied after the ADS term, the temperature and top-k, at every point",
        min=1e-3,
        max=1.0,
    )
    grad_scale: float = _f(
        1.0,
        "multiplies the loaded gradient g before ADS uses it; 0.125 reproduces the ADS reference, whose saved "
        "gradient is 1/8 of the mean (DDP already averages over its 8 processes and the reference divides again)",
        min=0.0,
    )
    eps: float = _f(1e-2, "finite-difference step along the gradient: proxies at θ+εg and θ−εg", min=1e-12)
    ads_method: str = _f(
        "fd",
        "fd: finite difference with two KV-cached proxies; jvp: exact torch.func.jvp, no cache (small models)",
        choices=("fd", "jvp"),
    )
    gen_batch_size: int = _f(256, "prompts per generation batch", min=1)
    sft_seed: int = _f(
        -1,
        "seed of the students' SFT order (and scratch initialisation); -1 means seed. The ADS "
        "reference distils with seed 69",
        min=-1,
    )
    repeats: int = _f(
        1,
        "runs of every point, with seeds seed, seed+1, ...: new sampling noise and SFT order; the mean is plotted",
        min=1,
    )
    sft_max_steps: int = _f(200, "optimizer steps of every student's SFT; -1 means sft_epochs", min=-1)
    sft_epochs: float = _f(3.0, "passes over the traces when sft_max_steps is -1", min=0.0)
    sft_batch_size: int = _f(64, "traces per optimizer step", min=1)
    sft_micro_batch_size: int = _f(
        0, "traces per forward pass (gradient accumulation); 0 means sft_batch_size", min=0
    )
    sft_learning_rate: float = _f(
        3e-3, "peak learning rate of the students' SFT (AdamW, warmup then cosine)", min=0.0
    )
    sft_weight_decay: float = _f(0.0, "AdamW weight decay of the students' SFT", min=0.0)
    sft_warmup_ratio: float = _f(0.05, "fraction of SFT steps spent warming up", min=0.0, max=0.999)
    sft_max_length: int = _f(0, "traces longer than this many student tokens are cut; 0 means no cap", min=0)
    bf16: bool = _f(
        False, "bf16 teacher and bf16 autocast for the students (GPU); the proxies always run in fp32"
    )
    gradient_checkpointing: bool = _f(False, "recompute the student's activations in backward to save memory")
    student_lora_r: int = _f(
        0,
        "LoRA rank of the distilled students (peft: pip install 'opdkit[lora]'); 0 fine-tunes every weight",
        min=0,
    )
    student_lora_alpha: float = _f(
        0.0, "LoRA alpha (the adapter's scale is alpha / r); 0 means student_lora_r", min=0.0
    )
    student_lora_dropout: float = _f(0.0, "dropout on the LoRA adapters' inputs", min=0.0, max=1.0)
    student_lora_target_modules: list = _f(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "modules of the student that get a LoRA adapter (names, or [all-linear])",
    )
    student_save: str = _f(
        "adapter",
        "what of each distilled student is kept in points/<name>/seed<seed>/student/: adapter (the LoRA "
        "adapter; without LoRA the whole model), merged (the model with the adapter merged in), none",
        choices=("adapter", "merged", "none"),
    )
    sft_save_steps: int = _f(
        0, "checkpoint each student every this many SFT steps (resume continues from it); 0 never", min=0
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lams", "answer_lams", "ads_temperatures", "temperatures"):
            setattr(self, name, _float_list(name, getattr(self, name)))
        if self.eval_size == 0:
            raise ConfigError(
                "eval_size=0 leaves every distilled student unmeasured, and the trade-off is their accuracy; "
                "give a positive number of evaluation problems, or -1 for all of eval_dataset_path."
            )
        if not (self.lams or self.answer_lams or self.temperatures):
            raise ConfigError(
                "lams, answer_lams and temperatures are all empty; give at least one sweep point."
            )
        if (self.lams or self.answer_lams) and not self.ads_temperatures:
            raise ConfigError(
                "an ADS sweep is set but ads_temperatures is empty; give the temperature ADS samples at, e.g. [1.0]."
            )
        negative = [(n, v) for n in ("ads_temperatures", "temperatures") for v in getattr(self, n) if v < 0]
        if negative:
            raise ConfigError(
                f"{negative[0][0]} holds {negative[0][1]}; temperatures are >= 0 (0 is greedy)."
            )
        self.student_lora_target_modules = _name_list(
            "student_lora_target_modules", self.student_lora_target_modules
        )


def _float_list(name: str, value: Any) -> list[float]:
    """A sweep as a list of floats, from a YAML/papermill list or a comma-separated string."""
    if isinstance(value, str):
        value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
    if isinstance(value, (int, float)):
        value = [value]
    try:
        return [float(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}={value!r} must be a list of numbers, e.g. [0.0, 0.05, 0.1] or '0,0.05,0.1'."
        ) from None


def _name_list(name: str, value: Any) -> list[str]:
    """Module names as a list of strings, from a YAML/papermill list or a comma-separated string."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(
            f"{name}={value!r} must be a list of module names, e.g. [q_proj, v_proj] or 'q_proj,v_proj'."
        )
    return [n.strip() for n in names]


JOBS: dict[str, type[RunFields]] = {
    "01_save_grad": SaveGradConfig,
    "02_whitebox": WhiteboxConfig,
    "03_clip_vs_noclip": ClipLessonConfig,
    "04_antidistill": AntidistillationConfig,
}
DEFAULT_MODE = "tiny"
NOTEBOOK_ONLY = {"mode"}  # notebook parameters that are not config fields


def check_ranges(cfg: Any) -> None:
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        meta = f.metadata
        if "min" in meta and value < meta["min"]:
            raise ConfigError(f"{f.name}={value!r} is below its minimum {meta['min']} ({meta['help']}).")
        if "max" in meta and value > meta["max"]:
            raise ConfigError(f"{f.name}={value!r} is above its maximum {meta['max']} ({meta['help']}).")
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"{f.name}={value!r} is not one of {list(meta['choices'])}.")


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
    """Resolve `mode`'s preset, apply `overrides` (None values are ignored), validate, return the dataclass."""
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
