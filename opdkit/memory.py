"""A per-process memory plan from the models' `config.json` alone, before any weight is loaded.

    shape = ModelShape.from_config  # a dict, a folder holding config.json, or a hub name (config.json only)
    p = plan(Stage(student=shape("Qwen/Qwen3-0.6B"), teacher=shape("Qwen/Qwen3-4B"), train_batch_size=4,
                   gen_batch_size=16, prompt_len=1024, completion_len=1024), budget_gb=80)
    print(p.table())  # component, GB, held when, how computed; "plan: 40.9 GB of 80.0 GB per process: fits"

A `Stage` is what one process holds at once (01_save_grad is two stages, the teacher writing traces and
then the proxy's gradient pass: plan both and keep the larger). A row is held "always" or in the phases
it names (rollout, train, bwd-end, step, eval); the phases follow one another, so the total is the
"always" rows plus the largest phase. GB are 10^9 bytes (an "80 GB" A100 or H100 reports about 85e9).
Against a budget every plan holds a reserve row (`reserve_bytes`: 5 % of the budget, at least 2 GB) for
what is not planned by component: the CUDA context, cuBLAS workspaces, NCCL buffers, allocator
fragmentation; `fits` and `largest_batch` (`gen_batch_size: 0`) count it, so neither plans into it.

Pitfalls this module exists for:
- Qwen3 sets `head_dim` (128) explicitly and hidden_size / heads is not it (64 for 0.6B, 80 for 4B):
  the quotient would understate the KV cache and the attention projections;
- a tied embedding is one tensor in the weights, but at the end of backward the head's gradient and the
  embedding's are two vocabulary x hidden tensors being summed;
- the kit's batches are left-padded, and with a padding mask transformers repeats k and v to every query
  head before SDPA and SDPA keeps the mask in the matmul dtype: a GQA model's attention activations grow
  by heads / KV heads, plus one value per column (`activation_bytes_per_token`, counted with
  `saved_tensors_hooks`); eager attention would also keep heads x length probabilities, not planned;
- under bf16 autocast an fp32 model's KV cache keeps K in fp32 (RoPE's fp32 cos and sin, Qwen3's fp32 k_norm
  weight, promote it) and V in bf16 (`kv_bytes_per_token`);
- vLLM reserves `gpu_memory_utilization` x the card's whole memory, not of a smaller budget;
- a vLLM weight sync that casts every parameter to the engine's dtype before handing them over holds the
  whole model in bf16; `engines.VLLMEngine.sync` streams them, one tensor at a time (`Stage.sync_streamed`);
- AdamW steps one tensor at a time on CPU but with `foreach` on CUDA, whose sqrt(v) temporary is as large
  as all parameters together;
- on CPU, torch 2.13's bf16 linear of the last position's (strided) hidden state (`logits_to_keep=1` in the
  kit's decoding loop) is a bmm against the head expanded to every row; where oneDNN takes bf16 matmuls (a
  CPU with AVX512-BF16 or AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`) that expansion is made
  contiguous, a copy of the head per row (128 rows of Qwen3-4B: 99.6 GB); elsewhere (an AVX2-only CPU) the
  BLAS bmm reads the expanded head in place and nothing is copied (`cpu_bf16_head_copies`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opdkit.config import ConfigError, MissingInput, one_line

GB = 1e9
ALWAYS = "always"
RESERVE_SHARE = 0.05  # of the budget, held back for what no row plans (`reserve_bytes`)
RESERVE_MIN_GB = 2.0
PHASES = ("rollout", "train", "bwd-end", "step", "eval")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
}

# Per model_type: (q/k RMSNorm, q/k/v bias, o bias); None: the config's `attention_bias` decides.
_FAMILIES: dict[str, tuple[bool, bool | None, bool | None]] = {
    "qwen3": (True, None, None),
    "qwen2": (False, True, False),
    "llama": (False, None, None),
    "mistral": (False, False, False),
}

# `losses.chunked_divergence` works on blocks of this many rows (`losses._ROW_BLOCK`) with about this
# many fp32 rows x vocabulary temporaries at once.
_ROW_BLOCK = 64
_ROW_BLOCK_BUFFERS = 3


def dtype_name(dtype: Any) -> str:
    """'bfloat16' for 'bfloat16', 'bf16', 'torch.bfloat16' or torch.bfloat16."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)} (or fp32, bf16, fp16).")
    return name


def dtype_bytes(dtype: Any) -> int:
    return DTYPE_BYTES[dtype_name(dtype)]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only model's sizes as its `config.json` gives them (Qwen3, Qwen2, Llama, Mistral)."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool
    dtype: str = "float32"  # the checkpoint's; a job loads in its own (Stage.*_dtype)
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    name: str = ""

    @classmethod
    def from_config(cls, source: Mapping[str, Any] | str | Path | Any, name: str = "") -> ModelShape:
        """From a config dict or `PretrainedConfig`, a folder holding config.json, the file itself,
        `tiny:<part>`, or a hub name (only its config.json is downloaded)."""
        if hasattr(source, "to_dict"):
            source = source.to_dict()
        if isinstance(source, Mapping):
            return cls._from_dict(source, name)
        text = str(source)
        return cls._from_dict(json.loads(_config_path(text).read_text()), name or text)

    @classmethod
    def _from_dict(cls, cfg: Mapping[str, Any], name: str) -> ModelShape:
        what = name or "the config"
        model_type = cfg.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(
                f"{what}: model_type {model_type!r} is not planned here (known: {sorted(_FAMILIES)}); add "
                "its layer layout to opdkit.memory._FAMILIES, or plan with a config of the same layout."
            )
        needed = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        missing = [k for k in needed if cfg.get(k) is None]
        if missing:
            raise ConfigError(f"{what} has no {missing}; pass a decoder-only model's config.json.")
        qk_norm, qkv_bias, o_bias = _FAMILIES[model_type]
        attention_bias = bool(cfg.get("attention_bias", False))
        heads = int(cfg["num_attention_heads"])
        return cls(
            model_type=model_type,
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype_name(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            qk_norm=qk_norm,
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            name=name,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """One decoder layer's matmul weights (what autocast casts): q, k, v, o, gate, up, down."""
        return sum(n_in * n_out for n_in, n_out in self.linear_shapes().values())

    @property
    def layer_params(self) -> int:
        """One decoder layer: projections and their biases, two RMSNorms, q/k RMSNorms (Qwen3)."""
        h, i = self.hidden_size, self.intermediate_size
        biases = (
            (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        )
        return self.layer_linear_params + biases + 2 * h + 2 * self.head_dim * self.qk_norm

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Embedding, layers, final norm, and the head unless tied: what `sum(p.numel())` counts."""
        head = 0 if self.tie_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + head

    @property
    def largest_tensor_numel(self) -> int:
        h = self.hidden_size
        return max(self.embedding_params, h * self.intermediate_size, h * self.q_dim)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each decoder layer's matmuls, by their module names."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params(self, rank: int, targets: list[str]) -> int:
        """The parameters LoRA adapters of `rank` add on the decoder layers' `targets` (module names, or
        ["all-linear"]): r x (in + out) each, what peft's `get_peft_model` makes trainable. Names that are
        not a layer's matmul add nothing."""
        shapes = self.linear_shapes()
        names = list(shapes) if list(targets) == ["all-linear"] else targets
        return self.num_layers * sum(rank * sum(shapes[t]) for t in names if t in shapes)


def _config_path(text: str) -> Path:
    if text.startswith("tiny:"):
        from opdkit import tiny

        text = tiny.resolve(text)
    path = Path(text).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") != 1:
        raise MissingInput(
            f"no config.json at {path}; pass a model folder holding config.json, the file itself, or a "
            "hub name such as Qwen/Qwen3-0.6B."
        )
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(text, "config.json"))
    except Exception as e:
        raise MissingInput(
            f"could not fetch config.json of {text!r} from the hub ({type(e).__name__}: {one_line(e)}); "
            "check the name and the network (HF_HUB_OFFLINE), or pass a local folder holding its config.json."
        ) from e


def kv_bytes_per_token(shape: ModelShape, dtype: Any, autocast: bool = False) -> int:
    """Keys and values of every layer for one token: layers x KV heads x head_dim x (K's + V's bytes).
    Both are in the weights' `dtype`, except under bf16 `autocast` where V is bf16 and K stays in the
    weights' dtype: the fp32 cos and sin of RoPE (and Qwen3's k_norm weight) promote K back to fp32."""
    k = dtype_bytes(dtype)
    v = min(k, 2) if autocast else k
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * (k + v)


def kv_dtypes(dtype: Any, autocast: bool = False) -> str:
    """The cache's dtypes as the plan says them: 'bfloat16', or 'K float32, V bfloat16' under autocast."""
    name = dtype_name(dtype)
    if autocast and dtype_bytes(name) > 2:
        return f"K {name}, V bfloat16"
    return name


def activation_bytes_per_token(
    shape: ModelShape, residual_bytes: int, compute_bytes: int, cast: bool, masked_len: int = 0
) -> int:
    """What autograd keeps per token in one decoder layer while training (SDPA attention), by count.

    r = `residual_bytes` (the trained weights' dtype), a = `compute_bytes` (2 under bf16 autocast); `cast`
    when autocast casts each projection's input anew (fp32 weights under bf16):
    - two RMSNorms on h: their fp32 input and normalised output, (4 + r) h each;
    - projection inputs: q, k, v, gate and up each keep their own cast (5 a h), or share the two norms'
      outputs (2 r h);
    - q/k RMSNorms (Qwen3): fp32 input and normalised output, (4 + a) per q and per k value;
    - SDPA: the rotated q and the output, 2 a per q value; k and v, 2 a per kv value, or per q value
      under a padding mask (`masked_len` > 0 columns: transformers repeats k and v to every query head),
      plus the mask, which SDPA keeps in the matmul dtype, a per column;
    - the MLP: gate, SiLU(gate), up and their product, 4 a per intermediate value;
    - fp32 statistics: the RMSNorms' 1 / rms (2, + heads + KV heads for q/k) and SDPA's log-sum-exp (heads).
    tests/test_memory.py checks it against `torch.autograd.graph.saved_tensors_hooks` on real layers.
    """
    h, a, r = shape.hidden_size, compute_bytes, residual_bytes
    qk = (4 + a) if shape.qk_norm else 0
    kv_kept = shape.q_dim if masked_len else shape.kv_dim
    return (
        h * (2 * (4 + r) + (5 * a if cast else 2 * r))
        + shape.q_dim * (2 * a + qk)
        + shape.kv_dim * qk
        + 2 * a * kv_kept
        + a * masked_len
        + 4 * a * shape.intermediate_size
        + 4 * (2 + shape.num_heads + (shape.num_heads + shape.num_kv_heads) * shape.qk_norm)
    )


def forward_working_bytes(shape: ModelShape, tokens: int, compute_bytes: int) -> int:
    """A no-grad forward's largest moment: one layer's residual, q, k, v, output, gate, up and their
    product alive together for `tokens` tokens."""
    width = 3 * shape.hidden_size + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate_size
    return tokens * compute_bytes * width


@dataclass(frozen=True)
class Row:
    """One component: bytes per process, held "always" or in the phases `phase` names (joined by "+")."""

    component: str
    bytes: int
    how: str
    phase: str = ALWAYS

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self.phase.split("+"))


@dataclass(frozen=True)
class Suggestion:
    """Settings (by the job's field names) under which the plan fits, and that plan's total."""

    settings: dict[str, Any]
    total_bytes: int

    def __str__(self) -> str:
        text = " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items()
        )
        return f"{text} ({self.total_bytes / GB:.1f} GB)"


@dataclass
class Plan:
    """Rows, the total (the always rows plus the largest phase), the budget, and what would fit it."""

    rows: list[Row]
    budget_bytes: float | None = None
    suggestions: list[Suggestion] = field(default_factory=list)

    def phase_totals(self) -> dict[str, int]:
        """Bytes held at each phase: the always rows plus that phase's."""
        always = sum(r.bytes for r in self.rows if r.phase == ALWAYS)
        phases = {p for r in self.rows if r.phase != ALWAYS for p in r.phases}
        totals = {p: always + sum(r.bytes for r in self.rows if p in r.phases) for p in phases}
        return totals or {ALWAYS: always}

    @property
    def peak_phase(self) -> str:
        totals = self.phase_totals()
        return max(totals, key=totals.__getitem__)

    @property
    def total(self) -> int:
        return max(self.phase_totals().values())

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.total <= self.budget_bytes

    def row(self, component: str) -> Row:
        for r in self.rows:
            if r.component == component:
                return r
        raise KeyError(f"no row {component!r} in this plan; it has {[r.component for r in self.rows]}")

    def summary(self) -> str:
        """`table()`'s last line: 'plan: <total> GB of <budget> GB per process: fits' (or 'does not fit')."""
        if self.budget_bytes is None:
            return f"plan: {self.total / GB:.1f} GB per process: no budget set"
        verdict = "fits" if self.fits else "does not fit"
        return f"plan: {self.total / GB:.1f} GB of {self.budget_bytes / GB:.1f} GB per process: {verdict}"

    def table(self) -> str:
        width = max(len("component"), *(len(r.component) for r in self.rows))
        held = max(len("held"), *(len(r.phase) for r in self.rows))
        lines = [f"{'component':<{width}}  {'GB':>7}  {'held':<{held}}  how computed"]
        lines += [
            f"{r.component:<{width}}  {r.bytes / GB:>7.2f}  {r.phase:<{held}}  {r.how}" for r in self.rows
        ]
        totals = sorted(self.phase_totals().items())
        lines.append("held at each phase: " + ", ".join(f"{p} {b / GB:.2f} GB" for p, b in totals))
        if not self.fits:
            if self.suggestions:
                lines.append("would fit with: " + "; ".join(map(str, self.suggestions)))
            else:
                lines.append("no setting brings it under: smaller models, more processes, or a larger GPU")
        lines.append(self.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """For the run folder (JSON-safe)."""
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "phase_totals": self.phase_totals(),
            "total_bytes": self.total,
            "peak_phase": self.peak_phase,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "suggestions": [{"settings": s.settings, "total_bytes": s.total_bytes} for s in self.suggestions],
        }


@dataclass(frozen=True)
class Stage:
    """What one process holds at once, in plain numbers; leave a model None or a batch 0 where the stage
    has none. Batches are rows per process.

    student: the trained model (02/03's student; 01's proxy in its gradient pass, with optimizer "none").
    teacher: frozen; under fsdp sharded too when `shard_teacher` (issue 20, item 6), else replicated.
    proxy: ADS (04): the proxy and `proxy_gradients` loaded gradients (in CPU memory when
        `proxy_on_host`), and `ads_copies` perturbed copies (finite differences: 2), each with a KV cache
        when the teacher samples (`sampler` "teacher"); when they score a student's rollouts (`sampler`
        "student", with a teacher) no cache, but the ADS teacher's stacked fp32 head.
    bf16: autocast mixed precision for training, the kit's rollouts and evaluation. eval_bf16: evaluation's
        own when it differs (None: `bf16`; 04 evaluates its students in fp32). device: "cuda" or "cpu"
        (AdamW's temporaries, the CPU bf16 head copies). cpu_bf16_head_copies: whether a bf16 decoding
        loop on CPU copies the head per row (None: as this host's torch does, `cpu_bf16_head_copies`).
    optimizer: "adamw" (2 states), "sgd" (with momentum: 1), "none" (gradients only).
    sampler: whose decoding with the kit's loop fills the rollout KV cache, `gen_batch_size` rows of
        prompt_len + completion_len tokens (02 samples every row of an optimizer step at once);
        with rollout_engine "vllm" the engine's share replaces it.
    eval_model, eval_batch_size: decoded with the kit's loop under autocast (0: no evaluation here).
    sync_streamed: the vLLM weight sync hands over one tensor at a time (as VLLMEngine.sync does).
    teacher_served: the teacher's final hidden states come from a server (`opd.served`, `teacher_server`):
        the process holds its head (vocabulary x hidden, in `teacher_dtype`) and a micro-batch's states (a
        step's, received in `served_dtype`, wait in host memory), never its layers; it neither decodes nor
        is sharded here.
    gpu_memory_gb: the visible card's whole memory (vLLM reserves its share of that); 0: not known here, the
        share is taken of the plan's budget and the row says so.
    trainable_params: the student's parameters the optimizer updates, when not all of them (LoRA: the
        adapters, `ModelShape.lora_params`); gradients and optimizer state are theirs, the frozen weights
        have none. 0: every parameter trains.
    cross_tokenizer: the teacher has another tokenizer (`opd.crossteacher`): the loss's chunks hold rows of
        both vocabularies, the student's and the teacher's own.
    """

    student: ModelShape | None = None
    teacher: ModelShape | None = None
    proxy: ModelShape | None = None
    student_dtype: str = "float32"
    teacher_dtype: str = "bfloat16"
    proxy_dtype: str = "float32"
    bf16: bool = True
    device: str = "cuda"
    cpu_bf16_head_copies: bool | None = None
    optimizer: str = "adamw"
    parallelism: str = "ddp"
    world_size: int = 1
    shard_teacher: bool = True
    gradient_checkpointing: bool = False
    prompt_len: int = 0
    completion_len: int = 0
    train_batch_size: int = 0
    loss_chunk_size: int = 1024
    sampler: str = "student"
    gen_batch_size: int = 0
    ads_copies: int = 2
    proxy_gradients: int = 1
    proxy_on_host: bool = False
    eval_model: str = "teacher"
    eval_batch_size: int = 0
    eval_completion_len: int = 0  # 0: completion_len
    eval_bf16: bool | None = None  # None: bf16
    rollout_engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_sleep: bool = False
    engine_dtype: str = "bfloat16"
    sync_streamed: bool = False
    trainable_params: int = 0
    teacher_served: bool = False
    served_dtype: str = "bfloat16"
    gpu_memory_gb: float = 0.0
    cross_tokenizer: bool = False

    def __post_init__(self) -> None:
        choices = {
            "optimizer": ("adamw", "sgd", "none"),
            "parallelism": ("ddp", "fsdp"),
            "sampler": ("student", "teacher"),
            "eval_model": ("student", "teacher"),
            "rollout_engine": ("hf", "vllm"),
            "device": ("cuda", "cpu"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}.")
        for name in ("world_size", "loss_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        counts = ("prompt_len", "completion_len", "train_batch_size", "gen_batch_size", "eval_batch_size")
        for name in (*counts, "eval_completion_len", "ads_copies", "proxy_gradients", "trainable_params"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative (0: none).")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} is not in (0, 1]."
            )
        for name in ("student_dtype", "teacher_dtype", "proxy_dtype", "engine_dtype", "served_dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name)))
        if self.train_batch_size and self.student is None:
            raise ValueError(
                "train_batch_size > 0 needs the trained model: pass student=ModelShape.from_config(...)."
            )
        for role, batch in (("sampler", self.gen_batch_size), ("eval_model", self.eval_batch_size)):
            if batch and getattr(self, getattr(self, role)) is None:
                raise ValueError(
                    f"{role}={getattr(self, role)!r} decodes, but that model is not in the stage; pass it or "
                    f"choose the other model."
                )

    @property
    def sharded(self) -> bool:
        return self.parallelism == "fsdp" and self.world_size > 1

    def model(self, role: str) -> tuple[ModelShape, str]:
        """(shape, dtype) of "student", "teacher" or "proxy"."""
        return getattr(self, role), getattr(self, f"{role}_dtype")


def _n(n: int) -> str:
    return f"{n:,}"


def _student_rows(s: Stage) -> list[Row]:
    m, wd = s.model("student")
    wb, w = dtype_bytes(wd), s.world_size
    div = w if s.sharded else 1
    per = f" / {w} (fsdp)" if div > 1 else ""
    states = {"adamw": 2, "sgd": 1, "none": 0}[s.optimizer]
    n = s.trainable_params or m.num_params  # what trains: gradients and optimizer state are theirs
    which = f"{_n(n)} trainable params" if s.trainable_params else "params"
    weights = m.num_params + s.trainable_params
    how = f"{_n(m.num_params)} params" + (
        f" + {_n(s.trainable_params)} adapter params" if s.trainable_params else ""
    )
    rows = [
        Row("student weights", weights * wb // div, f"{how} x {wb} B ({wd})" + per),
        Row("optimizer state", states * n * wb // div, f"{s.optimizer}: {states} x {which} x {wb} B" + per),
    ]
    if not s.train_batch_size:
        return rows
    rows.append(Row("student gradients", n * wb // div, f"{which} x {wb} B" + per, "train+bwd-end+step"))
    if m.tie_embeddings and not s.trainable_params:  # adapters leave the embedding frozen
        grad_bytes = 2 if (s.bf16 and s.sharded) else wb
        rows.append(
            Row(
                "tied embedding gradient sum",
                m.embedding_params * grad_bytes,
                f"the head's and the embedding's {_n(m.vocab_size)} x {m.hidden_size} gradients being summed",
                "bwd-end",
            )
        )
    if s.parallelism == "ddp" and w > 1:
        rows.append(Row("ddp gradient buckets", n * wb, "DDP's reducer keeps a flat copy of every gradient"))
    if s.optimizer == "adamw":
        if s.device == "cuda":
            temp, how = n * wb // div, "foreach AdamW: sqrt(v) of all parameters at once"
        else:
            largest = min(m.largest_tensor_numel, n)
            temp, how = 2 * largest * wb, "one tensor at a time: 2 x the largest tensor"
        rows.append(Row("optimizer step temporaries", temp, how, "step"))
    if s.sharded:
        # FSDP gathers the root unit and one decoder layer while it prefetches the next: in bf16 under
        # mixed precision, else in the weights' own dtype.
        unit = m.embedding_params * (1 if m.tie_embeddings else 2) + 2 * m.layer_params
        ub = 2 if s.bf16 else wb
        what = "mixed-precision copies" if s.bf16 else "fsdp gathered units"
        how = f"FSDP's {'bf16 ' if s.bf16 else ''}all-gathers: the root (embedding, head) + 2 decoder layers"
        how += f", {ub} B"
        rows.append(Row(what, unit * ub, how, "train"))
    elif s.bf16 and wb > 2:
        linear = m.num_layers * m.layer_linear_params
        how = f"autocast's bf16 casts of the {_n(linear)} layer weights, 2 B"
        rows.append(Row("mixed-precision copies", linear * 2, how, "train"))
    return rows + _training_rows(s)


def _training_rows(s: Stage) -> list[Row]:
    """Activations, and with a teacher the chunked divergence's buffers."""
    m, wd = s.model("student")
    residual = 2 if (s.bf16 and s.sharded) else dtype_bytes(wd)
    compute = 2 if s.bf16 else dtype_bytes(wd)
    cast = s.bf16 and residual > 2
    length = s.prompt_len + s.completion_len
    tokens, n_pred = s.train_batch_size * length, s.train_batch_size * s.completion_len
    per = activation_bytes_per_token(m, residual, compute, cast, masked_len=length)
    # The final norm's fp32 input and output; both models' final hidden states at the predicted positions.
    final = tokens * (4 + residual) * m.hidden_size + n_pred * m.hidden_size * residual
    if s.teacher is not None:
        final += n_pred * s.teacher.hidden_size * dtype_bytes(s.teacher_dtype)
    if s.gradient_checkpointing:
        act = tokens * (m.num_layers * m.hidden_size * residual + per) + final
        how = f"{_n(tokens)} tokens x ({m.num_layers} layer inputs x {m.hidden_size} x {residual} B + 1 layer"
    else:
        act = tokens * m.num_layers * per + final
        how = f"{_n(tokens)} tokens x ({m.num_layers} layers"
    how += f" x {_n(per)} B/token/layer) + final norm and hidden states"
    rows = [Row("activations", act, how, "train")]
    if s.teacher is None:
        return rows
    if s.cross_tokenizer:
        return rows + [_cross_tokenizer_chunk(s, m, n_pred)]
    vocab, chunk = min(m.vocab_size, s.teacher.vocab_size), min(s.loss_chunk_size, n_pred)
    # The divergence runs outside autocast: each head's matmul is in its weights' dtype (the student's is
    # bf16 only as FSDP's unsharded copy); a half-precision product is converted to fp32 beside the other.
    s_head = 2 if (s.bf16 and s.sharded) else dtype_bytes(wd)
    low = min(s_head, dtype_bytes(s.teacher_dtype))
    per_row = 8 + (low if low < 4 else 0)
    how = f"{_n(chunk)} rows x {_n(vocab)} x {per_row} B (both log-probs in fp32"
    how += f", a {low} B matmul output)" if low < 4 else ")"
    how += f" + {_ROW_BLOCK} x {_ROW_BLOCK_BUFFERS} fp32 row-block buffers"
    chunk_bytes = chunk * vocab * per_row + _ROW_BLOCK * _ROW_BLOCK_BUFFERS * vocab * 4
    rows.append(Row("divergence chunk logits", chunk_bytes, how, "train"))
    if s_head < 4:
        how = "the head's gradient summed in fp32 over the chunks (the unsharded head is bf16)"
        rows.append(Row("divergence head gradient", m.embedding_params * 4, how, "train"))
    elif s.parallelism == "ddp" and s.world_size > 1 and not s.trainable_params:
        how = "the head's fp32 gradient from the divergence, beside the .grad DDP's reducer allocates"
        rows.append(Row("divergence head gradient", m.embedding_params * 4, how, "train"))
    return rows


def _cross_tokenizer_chunk(s: Stage, m: ModelShape, n_pred: int) -> Row:
    """GOLD's loss, `loss_chunk_size` groups at a time (at most one per student token): each side's log-probs
    and merged probabilities in fp32 at its own vocabulary, and the sorted L1's keys and buckets; the
    backward pass (`crosstok._StudentLoss`) rebuilds each chunk into the same buffers. Not counted: the head's
    gradient it returns whole, which stands beside `.grad` while micro-batches accumulate."""
    chunk, both = min(s.loss_chunk_size, n_pred), m.vocab_size + s.teacher.vocab_size
    how = f"{_n(chunk)} groups x ({_n(m.vocab_size)} + {_n(s.teacher.vocab_size)} teacher) x 16 B"
    return Row("cross-tokenizer chunk", chunk * both * 16, how, "train")


def cpu_bf16_head_copies() -> bool:
    """Whether this host's torch copies the head once per row in a bf16 decoding step on CPU: oneDNN takes
    its bf16 matmuls (AVX512-BF16 or AMX), and makes the head expanded to every row contiguous; an AVX2-only
    CPU's BLAS bmm reads it in place (measured: tests/test_memory.py)."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _decode_rows(s: Stage, role: str, batch: int, length: int, phase: str, autocast: bool) -> list[Row]:
    """The kit's KV-cached loop: the cache (in the dtypes the model keeps it, `kv_bytes_per_token`), the
    prefill's working set, and on CPU the bf16 head copies where this torch makes them."""
    m, weights = s.model(role)
    what = f"{role} {'rollout' if phase == 'rollout' else 'evaluation'}"
    per = kv_bytes_per_token(m, weights, autocast)
    kv = batch * length * per
    compute = 2 if autocast else dtype_bytes(weights)
    work = forward_working_bytes(m, batch * s.prompt_len, compute)
    work += kv // m.num_layers + 3 * batch * m.vocab_size * 4
    rows = [
        Row(
            f"KV cache, {what}",
            kv,
            f"{batch} rows x {_n(length)} tokens x {_n(per)} B/token ({kv_dtypes(weights, autocast)})",
            phase,
        ),
        Row(
            f"decoding working set, {what}",
            work,
            "prefill: one layer's tensors for every prompt token; a layer's cache being extended; logits",
            phase,
        ),
    ]
    bf16_on_cpu = s.device == "cpu" and dtype_bytes(weights) == 2
    if bf16_on_cpu and (cpu_bf16_head_copies() if s.cpu_bf16_head_copies is None else s.cpu_bf16_head_copies):
        how = (
            f"{batch} rows x the head ({_n(m.vocab_size)} x {m.hidden_size} x 2 B): torch's CPU bf16 linear "
        )
        how += "copies the weight per row of a strided input (oneDNN's bf16 bmm)"
        rows.append(Row(f"CPU {weights} head copies, {what}", batch * m.embedding_params * 2, how, phase))
    return rows


def _engine_rows(s: Stage, budget: float | None) -> list[Row]:
    if budget is None:
        raise ValueError(
            "rollout_engine=vllm reserves a share of the GPU's memory: pass budget_gb (the GPU's memory, or "
            "plan_gpu_memory_gb) so the plan can size it."
        )
    card = s.gpu_memory_gb * GB or budget
    whose = "the visible GPU's memory" if s.gpu_memory_gb else "the budget (no GPU visible: its memory)"
    how = f"vllm_gpu_memory_utilization {s.vllm_gpu_memory_utilization} x {card / GB:.1f} GB, {whose}"
    phase = ALWAYS
    if s.vllm_sleep:
        how, phase = how + ", freed between rollouts (vllm_sleep)", "rollout"
    rows = [Row("rollout engine (vllm)", int(s.vllm_gpu_memory_utilization * card), how, phase)]
    if s.student is not None:
        m, wd = s.model("student")
        eb = dtype_bytes(s.engine_dtype)
        if s.sync_streamed:
            sync, how = m.largest_tensor_numel * eb, "one tensor at a time: the largest"
        elif wd != s.engine_dtype or s.sharded:
            sync, how = m.num_params * eb, f"every parameter in {s.engine_dtype} at once (VLLMEngine.sync)"
        else:
            sync, how = 0, "the live parameters themselves (same dtype, not sharded)"
        rows.append(Row("weight-sync buffer", sync, how, "rollout"))
    return rows


def _sharded_teacher_rows(s: Stage) -> list[Row]:
    """What a sharded teacher holds whole beyond its shard: while it decodes, its root unit (embedding,
    head) and one decoder layer gathered; in training, the copy of its head the divergence keeps from the
    loss's forward to its backward (`DistillTrainer._teacher_part`)."""
    m, dt = s.model("teacher")
    b = dtype_bytes(dt)
    rows = []
    if s.train_batch_size:
        how = f"{_n(m.embedding_params)} x {b} B, from the loss's forward to its backward"
        rows.append(Row("teacher head copy (fsdp)", m.embedding_params * b, how, "train"))
    decodes = [
        phase
        for phase, runs in (
            ("rollout", s.gen_batch_size and s.sampler == "teacher" and s.rollout_engine == "hf"),
            ("eval", s.eval_batch_size and s.eval_model == "teacher"),
        )
        if runs
    ]
    if decodes:
        root = m.embedding_params * (1 if m.tie_embeddings else 2)
        how = f"(root {_n(root)} + one layer {_n(m.layer_params)} params) x {b} B, while it decodes"
        rows.append(Row("teacher gathered units (fsdp)", (root + m.layer_params) * b, how, "+".join(decodes)))
    return rows


def _served_teacher_rows(s: Stage) -> list[Row]:
    """A served teacher (`opd.served.ServedTeacher`): its head, and one micro-batch's states in the padded
    layout; the step's states as received (each row's from its last prompt token on) wait in host memory."""
    m, dt = s.model("teacher")
    h, sb, tb = m.hidden_size, dtype_bytes(s.served_dtype), dtype_bytes(dt)
    kept = s.gen_batch_size * (s.completion_len + 1)
    padded = s.train_batch_size * (s.prompt_len + s.completion_len)
    return [
        Row(
            "teacher head (served teacher)",
            m.embedding_params * tb,
            f"{_n(m.embedding_params)} x {tb} B ({dt})",
        ),
        Row(
            "served teacher states",
            padded * h * tb,
            f"{_n(padded)} tokens x {h} x {tb} B; the step's {_n(kept)} tokens x {h} x {sb} B "
            f"({s.served_dtype}) wait in host memory",
            "train",
        ),
    ]


def _rows(s: Stage, budget: float | None) -> list[Row]:
    rows: list[Row] = _student_rows(s) if s.student is not None else []
    if s.teacher is not None and s.teacher_served:
        rows += _served_teacher_rows(s)
    elif s.teacher is not None:
        m, dt = s.model("teacher")
        div = s.world_size if (s.sharded and s.shard_teacher) else 1
        how = f"{_n(m.num_params)} params x {dtype_bytes(dt)} B ({dt})" + (
            f" / {div} (fsdp)" if div > 1 else ""
        )
        rows.append(Row("teacher weights", m.num_params * dtype_bytes(dt) // div, how))
        if div > 1:
            rows += _sharded_teacher_rows(s)
    if s.proxy is not None:
        m, dt = s.model("proxy")
        b, n = m.num_params * dtype_bytes(dt), _n(m.num_params)
        host = "in CPU memory (proxy_on_host)"
        grads = s.proxy_gradients * m.num_params * 4
        rows += [
            Row(
                "ADS proxy",
                0 if s.proxy_on_host else b,
                host if s.proxy_on_host else f"{n} params x 4 B ({dt})",
            ),
            Row(
                "ADS proxy gradients",
                0 if s.proxy_on_host else grads,
                host if s.proxy_on_host else f"{s.proxy_gradients} x {n} params x 4 B (float32)",
            ),
            Row(
                "ADS perturbed copies", s.ads_copies * b, f"{s.ads_copies} x {n} params x {dtype_bytes(dt)} B"
            ),
        ]
    length = s.prompt_len + s.completion_len
    if s.rollout_engine == "vllm":
        rows += _engine_rows(s, budget)
    elif s.gen_batch_size:
        rows += _decode_rows(s, s.sampler, s.gen_batch_size, length, "rollout", s.bf16)
        # Steering the teacher's sampling, the copies decode beside it, each with its KV cache; scoring a
        # student's rollouts (04's on-policy attackers, `sampler` "student"), they read whole sequences.
        if s.proxy is not None and s.ads_copies and s.sampler == "teacher":
            m, dt = s.model("proxy")
            per = kv_bytes_per_token(m, dt, s.bf16)
            how = f"{s.ads_copies} copies x {s.gen_batch_size} rows x {_n(length)} tokens x {_n(per)} B/token"
            rows.append(
                Row(
                    "KV cache, ADS perturbed copies",
                    s.ads_copies * s.gen_batch_size * length * per,
                    how,
                    "rollout",
                )
            )
    if s.proxy is not None and s.ads_copies and s.teacher is not None and s.sampler == "student":
        rows.append(_stacked_head_row(s))
    if s.eval_batch_size:
        eval_len = s.prompt_len + (s.eval_completion_len or s.completion_len)
        autocast = s.bf16 if s.eval_bf16 is None else s.eval_bf16
        rows += _decode_rows(s, s.eval_model, s.eval_batch_size, eval_len, "eval", autocast)
    return rows


def _stacked_head_row(s: Stage) -> Row:
    """The ADS teacher scoring a student's rollouts (04's on-policy attackers, `ads.teacher`) puts the
    teacher's and the perturbed copies' heads side by side in one fp32 matrix, built once."""
    t, p = s.teacher, s.proxy
    cols = t.hidden_size + s.ads_copies * p.hidden_size
    bytes_ = max(4, dtype_bytes(s.teacher_dtype), dtype_bytes(s.proxy_dtype))
    how = f"{_n(t.vocab_size)} x ({t.hidden_size} + {s.ads_copies} x {p.hidden_size}) x {bytes_} B"
    return Row("ADS teacher stacked head", t.vocab_size * cols * bytes_, how)


def plan(stage: Stage, budget_gb: float | None = None, suggest: bool = True) -> Plan:
    """The plan of `stage` against `budget_gb` (None: no budget, nothing enforced); when it does not fit,
    `suggestions` holds settings that would bring it under, each checked by planning again."""
    budget = None if budget_gb is None else budget_gb * GB
    rows = _rows(stage, budget)
    if budget is not None:
        rows.append(_reserve_row(budget))
    p = Plan(rows, budget)
    if suggest and not p.fits:
        p.suggestions = suggestions(stage, budget_gb)
    return p


def reserve_bytes(budget_bytes: float) -> int:
    """What a plan against `budget_bytes` holds back for what no row plans: the CUDA context (0.3-0.6 GB),
    cuBLAS and cuDNN workspaces, NCCL's buffers (about 0.3-1 GB per communicator), and the caching
    allocator's fragmentation, which grows with what is allocated: `RESERVE_SHARE` of the budget, at least
    `RESERVE_MIN_GB`."""
    return int(max(RESERVE_MIN_GB * GB, RESERVE_SHARE * budget_bytes))


def _reserve_row(budget: float) -> Row:
    how = (
        f"max({RESERVE_MIN_GB:g} GB, {RESERVE_SHARE:.0%} of {budget / GB:.1f} GB): CUDA context, cuBLAS "
        "workspaces, NCCL buffers, allocator fragmentation"
    )
    return Row("reserve", reserve_bytes(budget), how)


def largest_batch(stage: Stage, budget_gb: float, field: str = "gen_batch_size", limit: int = 65536) -> int:
    """The largest `field` (gen_batch_size, eval_batch_size or train_batch_size, at most `limit`) whose plan
    fits `budget_gb`; 0 if not even 1 does. What `gen_batch_size: 0` means in 01 and 04."""
    if field not in ("gen_batch_size", "eval_batch_size", "train_batch_size"):
        raise ValueError(
            f"field={field!r}: largest_batch sizes gen_batch_size, eval_batch_size or train_batch_size."
        )
    if field == "gen_batch_size" and stage.rollout_engine == "vllm":
        raise ValueError(
            "with rollout_engine=vllm the engine batches within its share: size the share instead."
        )

    def fits(n: int) -> bool:
        return plan(dataclasses.replace(stage, **{field: n}), budget_gb, suggest=False).fits

    if limit < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1)
    while hi - lo > 1:  # fits(lo); hi does not fit or is past the limit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def suggestions(stage: Stage, budget_gb: float) -> list[Suggestion]:
    """Settings that bring `stage` under `budget_gb`, each checked by planning again: every single change
    that does (a smaller gen_batch_size or eval_batch_size, vllm_gpu_memory_utilization, parallelism=fsdp,
    gradient_checkpointing), else the smallest-found combination of them; [] when nothing does."""
    changes: list[dict[str, Any]] = []
    if stage.gen_batch_size > 1 and stage.rollout_engine == "hf":
        changes.append({"gen_batch_size": _largest(stage, budget_gb, "gen_batch_size")})
    if stage.eval_batch_size > 1:
        changes.append({"eval_batch_size": _largest(stage, budget_gb, "eval_batch_size")})
    if stage.rollout_engine == "vllm":
        changes.append(
            {"vllm_gpu_memory_utilization": _largest(stage, budget_gb, "vllm_gpu_memory_utilization")}
        )
    if stage.parallelism == "ddp" and stage.world_size > 1:
        changes.append({"parallelism": "fsdp"})
    if stage.train_batch_size and not stage.gradient_checkpointing:
        changes.append({"gradient_checkpointing": True})
    # A batch or share of 0 (none fits alone) is no suggestion by itself, but may be one with the others.
    fitting = [c for c in changes if 0 not in c.values() and _fits(stage, budget_gb, c)]
    if not fitting:
        # Everything at once (the smallest batches and share), then each setting back where the others
        # allow: dropped if they fit without it, else its largest value that fits with them.
        together = {k: v for c in changes for k, v in c.items()}
        smallest = {
            k: 1 if k.endswith("batch_size") else 0.05 if k.startswith("vllm") else v
            for k, v in together.items()
        }
        if not smallest or not _fits(stage, budget_gb, smallest):
            return []
        together = smallest
        for key in list(together):
            others = {k: v for k, v in together.items() if k != key}
            if others and _fits(stage, budget_gb, others):
                together = others
            elif key in _LARGEST:
                together[key] = (
                    _largest(dataclasses.replace(stage, **others), budget_gb, key) or together[key]
                )
        fitting = [together]
    return [
        Suggestion(c, plan(dataclasses.replace(stage, **c), budget_gb, suggest=False).total) for c in fitting
    ]


_LARGEST = ("gen_batch_size", "eval_batch_size", "vllm_gpu_memory_utilization")


def _largest(stage: Stage, budget_gb: float, key: str) -> int | float:
    """The largest value of `key` below the stage's own that fits (a batch, or a share in steps of 0.05);
    0 when none does."""
    if key == "vllm_gpu_memory_utilization":
        shares = [pct / 100 for pct in range(round(stage.vllm_gpu_memory_utilization * 100) - 5, 4, -5)]
        return next((x for x in shares if _fits(stage, budget_gb, {key: x})), 0)
    return largest_batch(stage, budget_gb, key, getattr(stage, key) - 1)


def _fits(stage: Stage, budget_gb: float, change: dict[str, Any]) -> bool:
    return plan(dataclasses.replace(stage, **change), budget_gb, suggest=False).fits


# ---------------------------------------------------------------- a job's plan: budget, stages, verdict


def visible_gpu_memory_gb() -> float | None:
    """The first visible GPU's memory in GB (1e9 B), None without a GPU. Read through NVML or nvidia-smi,
    which leave CUDA uninitialised, so that a notebook can still fork one process per GPU afterwards."""
    import torch

    count = torch.cuda.device_count()  # NVML-based where it can be: safe before a fork
    if count == 0:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", first, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(out.split()[0]) * 2**20 / GB  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    if count == 1:  # one process, no fork to protect: CUDA may be initialised here
        return torch.cuda.get_device_properties(0).total_memory / GB
    raise ConfigError(
        f"{count} GPUs are visible but their memory could not be read without initialising CUDA (no "
        "nvidia-smi); set plan_gpu_memory_gb to one GPU's memory in GB, e.g. plan_gpu_memory_gb=80."
    )


def budget_gb(plan_gpu_memory_gb: float) -> float | None:
    """The memory one process's plan must fit: `plan_gpu_memory_gb` when set, else the visible GPU's; None
    (nothing enforced) on a CPU without it."""
    return plan_gpu_memory_gb if plan_gpu_memory_gb > 0 else visible_gpu_memory_gb()


PLAN_FILE = "plan.json"  # a run folder's copy of its plan (JobPlan.to_json)
HELD_DIR = "held"  # a run folder's record of what each process holds after loading: held/rank<k>.json


def held_by(model: Any) -> dict[str, Any]:
    """What this process holds of `model`, counted on its tensors: `params` and `bytes` of the parameters
    as they sit here (a DTensor's local shard under FSDP), `of_params` the model's whole count, and the
    dtypes and devices found. A sharding that silently failed shows as params == of_params."""
    params = nbytes = whole = 0
    dtypes, devices = set(), set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params += local.numel()
        nbytes += local.numel() * local.element_size()
        whole += p.numel()
        dtypes.add(dtype_name(local.dtype))
        devices.add(str(local.device))
    return {
        "params": params,
        "bytes": nbytes,
        "of_params": whole,
        "dtypes": sorted(dtypes),
        "devices": sorted(devices),
    }


def held_line(record: Mapping[str, Any]) -> str:
    """'rank 0 of 2 holds student 1,234 of 2,468 params (0.00 GB), teacher ...' from `held` records."""
    parts = [
        f"{role} {_n(h['params'])} of {_n(h['of_params'])} params ({h['bytes'] / GB:.2f} GB, "
        f"{'/'.join(h['dtypes'])} on {'/'.join(h['devices'])})"
        for role, h in record["models"].items()
    ]
    return f"rank {record['rank']} of {record['world_size']} holds " + ", ".join(parts)


def optimizer_kind(optim: str, optim_args: str = "") -> str:
    """A transformers `optim` name as the plan counts its state: "adamw" (2 states, also for any optimizer
    not known here), "sgd" with momentum (1), "none" for plain SGD (gradients only)."""
    if optim.startswith("sgd"):
        return (
            "sgd" if "momentum" in optim_args and "momentum=0" not in optim_args.replace(" ", "") else "none"
        )
    return "adamw"


@dataclass
class JobPlan:
    """A job's plan: every stage's (the stages follow one another) and the largest, which decides."""

    plans: dict[str, Plan]

    @property
    def stage(self) -> str:
        return max(self.plans, key=lambda name: self.plans[name].total)

    @property
    def plan(self) -> Plan:
        return self.plans[self.stage]

    @property
    def fits(self) -> bool:
        return self.plan.fits

    def table(self) -> str:
        """The largest stage's table (its last line the verdict), headed by every stage's total."""
        head = "memory plan per process"
        if len(self.plans) > 1:
            totals = ", ".join(f"{name} {p.total / GB:.1f} GB" for name, p in self.plans.items())
            head += f", stages {totals}; the largest, {self.stage}:"
        else:
            head += f", {self.stage}:"
        return head + "\n" + self.plan.table()

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            **self.plan.to_dict(),
            "stages": {k: p.to_dict() for k, p in self.plans.items()},
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def check(self) -> None:
        """Raise ConfigError, one line with the verdict and what would fit (the table is shown before), when
        the plan does not fit its budget."""
        if not self.fits:
            plan = self.plan
            fix = (
                f"it would fit with {'; '.join(map(str, plan.suggestions))}"
                if plan.suggestions
                else "no setting brings it under"
            )
            raise ConfigError(
                f"this run does not fit its memory budget, nothing has been loaded: {plan.summary()} at "
                f"{self.stage} (the plan above); {fix}; or use more processes or a larger GPU, or set "
                "plan_gpu_memory_gb if the budget is not this GPU's."
            )


def card_gb() -> float | None:
    """The visible GPU's memory in GB, None when there is none or it cannot be read without CUDA."""
    try:
        return visible_gpu_memory_gb()
    except ConfigError:
        return None


def plan_job(stages: Mapping[str, Stage], budget: float | None, gpu_gb: float | None = None) -> JobPlan:
    """Plan each stage of a job against `budget` GB (None: nothing enforced). A vLLM engine's share is taken
    of `gpu_gb` (the visible card's memory, `card_gb`) when given, else of the budget; without a budget of
    this machine's memory, as vLLM on a CPU takes it."""
    plans = {}
    for name, stage in stages.items():
        if gpu_gb:
            stage = dataclasses.replace(stage, gpu_memory_gb=gpu_gb)
        if budget is None and stage.rollout_engine == "vllm":
            p = plan(stage, _host_memory_gb(), suggest=False)
            p.budget_bytes = None
        else:
            p = plan(stage, budget)
        plans[name] = p
    return JobPlan(plans)


def _host_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
