"""A decoder-only model's sizes from its `config.json` (`ModelShape`), and the bytes of each dtype."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opdkit.config import ConfigError, MissingInput, one_line

GB = 1e9
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
                f"{what}: model_type {model_type!r} is not planned here (known: {sorted(_FAMILIES)}); "
                "add its layer layout to opdkit.memory.shapes._FAMILIES, or plan with a config of the same "
                "layout."
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
    def state_dict_numel(self) -> int:
        """What `sum(v.numel() for v in model.state_dict().values())` counts: the parameters, a tied embedding
        under both its names (the embedding's and the head's)."""
        return self.num_params + self.embedding_params * self.tie_embeddings

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
