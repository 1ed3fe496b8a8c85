"""Models and tokenizers: one loader for each, one pad policy, the stop tokens a model really uses.

    tok = load_tokenizer("tiny:student")                 # or a local folder, or a hub name
    model = load_model("tiny:teacher", torch.bfloat16, "cuda")
    eos_ids(tok, model)                                  # [151643, 151645] for Qwen3

Pitfalls this module exists for:
- pad policy: prompts are left-padded; a tokenizer without a pad token pads with its EOS, which is safe
  because completion masks end at the first EOS (`rollout.completion_mask`), never at `!= pad`;
- a tokenizer without an EOS cannot end a completion: that is an error here, not a silent 1024-token run;
- stop tokens are the tokenizer's EOS and the model's `generation_config.eos_token_id` list (Qwen3 stops
  at both <|im_end|> and <|endoftext|>).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from opdkit import tiny
from opdkit.config import ConfigError, MissingInput, one_line


class TokenizerMismatch(ConfigError):
    """Models or tokenizers that do not belong together (token ids would mean different things)."""


def resolve(name: str) -> str:
    """`tiny.resolve(name)`, with a local path that is not there as bad input (`MissingInput`) before
    transformers takes it for a hub name."""
    try:
        path = tiny.resolve(name)
    except FileNotFoundError as exc:
        raise MissingInput(str(exc)) from None
    if path.startswith((".", "/", "~")) and not os.path.exists(os.path.expanduser(path)):
        raise MissingInput(
            f"no model or tokenizer folder at {path!r}; pass a local folder holding config.json and the "
            "tokenizer's files, a hub name such as Qwen/Qwen3-0.6B, or tiny:teacher / tiny:student."
        )
    return path


# Tokenizers loaded in this process, by what their files hold (`tokenizer_key`). A Qwen3 tokenizer takes 0.7
# s to load, a dry run asks for each several times (03: each arm's prepare and plan), and a preset's models
# often ship one tokenizer (04 full: teacher, proxy and student, all Qwen3's).
_LOADED: dict[str, PreTrainedTokenizerBase] = {}
_KEYS: dict[tuple, str] = {}  # files_stamp -> tokenizer_key, so unchanged files are hashed once
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
MODEL_FILES = {"config.json", "generation_config.json", "recipe.json"}  # read by no tokenizer (see below)


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """A tokenizer padding on the left; without a pad token, its EOS pads. A name that cannot be loaded
    (no such folder, an unknown hub name, no network) is bad input (`ConfigError`). Loaded once per process
    for each content of its files (`tokenizer_key`): every caller of one name, or of folders holding the same
    tokenizer files, gets the same object, so none may change it."""
    path = resolve(name)
    key = tokenizer_key(path)
    if key is not None and key in _LOADED:
        return _LOADED[key]
    tok = _read_tokenizer(name, path)
    if key is not None:
        _LOADED[key] = tok
    return tok


def tokenizer_key(path: str) -> str | None:
    """A digest of what the tokenizer at `path` is loaded from: every file of its folder but the weights and
    the model's own files (`MODEL_FILES`), and the config's `model_type` (which `AutoTokenizer` falls back on
    without a `tokenizer_class`); None where no local folder holds it yet. Hashed once while the folder's
    files keep their sizes and times (`files_stamp`)."""
    stamp = files_stamp(path)
    if stamp is None:
        return None
    if stamp not in _KEYS:
        folder, digest = stamp[0], hashlib.blake2b(digest_size=16)
        for name, _, _ in stamp[1:]:
            if name in MODEL_FILES or name.endswith(WEIGHT_SUFFIXES):
                continue
            digest.update(name.encode() + b"\0")
            digest.update(Path(folder, name).read_bytes())
        config = Path(folder, "config.json")
        model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
        digest.update(f"model_type={model_type}".encode())
        _KEYS[stamp] = digest.hexdigest()
    return _KEYS[stamp]


def files_stamp(path: str) -> tuple | None:
    """(name, size, mtime) of every file in the tokenizer's folder (a hub name's cached snapshot), to tell a
    loaded tokenizer from one whose files changed since; None where no local folder holds it yet."""
    folder = path if os.path.isdir(path) else hub_snapshot(path)
    if folder is None:
        return None
    entries = [(e.name, e.stat()) for e in os.scandir(folder) if e.is_file()]
    return (folder, *sorted((name, st.st_size, st.st_mtime_ns) for name, st in entries))


def hub_snapshot(name: str) -> str | None:
    """The folder of the hub cache's snapshot of `name` that transformers would read offline, or None (not
    cached, or not a hub name)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "tokenizer_config.json")
    except ValueError:  # not a repo id (huggingface_hub's HFValidationError)
        return None
    return os.path.dirname(found) if isinstance(found, str) else None


class _ConfigFields:
    """The fields of a model's config.json that `AutoTokenizer` reads, where the tokenizer's own config names
    its class: then `AutoTokenizer` picks that class from them as from the model's config object (its
    `model_type`, the name it was loaded by, a `tokenizer_class` or `model_name` it declares), and building
    that object, which imports its model's configuration module (a llama config: transformers' activations,
    kernels and model loading, about 0.5 s), is skipped. Equal tokenizers either way: tests/test_models.py."""

    def __init__(self, fields: dict, name_or_path: str):
        self.model_type = fields["model_type"]
        self._name_or_path = name_or_path
        self.tokenizer_class = fields.get("tokenizer_class")
        if "model_name" in fields:
            self.model_name = fields["model_name"]


def config_fields(path: str) -> _ConfigFields | None:
    """`_ConfigFields` of the folder (or cached hub snapshot) at `path`, where its tokenizer_config.json
    names a tokenizer class and no remote code and its config.json a `model_type`; else None (then
    `AutoTokenizer` builds the model's config itself)."""
    folder = path if os.path.isdir(path) else hub_snapshot(path)
    if folder is None:
        return None
    try:
        tok_config = json.loads(Path(folder, "tokenizer_config.json").read_text())
        fields = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not tok_config.get("tokenizer_class") or "auto_map" in tok_config or not fields.get("model_type"):
        return None
    return _ConfigFields(fields, path)


def _read_tokenizer(name: str, path: str) -> PreTrainedTokenizerBase:
    """`load_tokenizer`'s load from the files, every time."""
    fields = config_fields(path)
    extra = {"config": fields} if fields is not None else {}
    try:
        tok = AutoTokenizer.from_pretrained(path, padding_side="left", **extra)
    except OSError as exc:
        raise ConfigError(
            f"cannot load the tokenizer of {name!r} ({type(exc).__name__}: {one_line(exc)}); check the "
            "name and the network (HF_HUB_OFFLINE), or pass a local folder."
        ) from exc
    if tok.eos_token is None:
        raise ConfigError(
            f"the tokenizer of {name} has no EOS token, so completions cannot end; set tokenizer.eos_token."
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def check_chat_template(tok: PreTrainedTokenizerBase, name: str) -> None:
    """A tokenizer that renders the prompts as chats has a chat template; one without (a base model's) is bad
    input, refused before anything is written rather than by transformers in the middle of the start."""
    if not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"the tokenizer of {name} has no chat template, and the prompts are rendered as chats with it; "
            "use an instruct or chat model's tokenizer, or give its tokenizer_config.json a chat_template."
        )


# Below this size a model's matmuls are too small to gain from several CPU threads; on a shared or
# busy machine the threads' spin-waits make them slower instead (measured: 02 tiny took 3x longer
# headless with 2 threads than with 1 on 2 busy cores; see README, "Watching a run").
SMALL_MODEL_PARAMS = 20_000_000


def load_model(
    name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # seconds to import: not at the kit's import (a dry run)

    model = AutoModelForCausalLM.from_pretrained(resolve(name), dtype=dtype).to(device)
    one_thread_for_small_models(model)
    return model


def one_thread_for_small_models(model: torch.nn.Module) -> None:
    """One torch thread for a small model on the CPU, unless the user chose a count (OMP_NUM_THREADS), as a
    JupyterLab kernel's user has usually not. `launch.launch` restores the caller's count afterwards."""
    device = next(model.parameters()).device
    if (
        device.type == "cpu"
        and "OMP_NUM_THREADS" not in os.environ
        and num_params(model) < SMALL_MODEL_PARAMS
    ):
        torch.set_num_threads(1)


def model_skeleton(name: str) -> torch.nn.Module:
    """The model's architecture without weights (meta device): enough to check a gradient's names and
    shapes."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve(name))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module | None = None) -> list[int]:
    """The tokenizer's EOS and whatever the model's generation config also stops at (a DDP-wrapped model's
    too)."""
    model = getattr(model, "module", model)
    extra = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
    return sorted({tokenizer.eos_token_id, *extra})


def checkpointing_argument(enabled: bool) -> dict[str, bool]:
    """TrainingArguments' activation-checkpointing switch under its name in this transformers: 5.24 renamed
    `gradient_checkpointing` (now deprecated, with a FutureWarning) to `activation_checkpointing`; the vLLM
    CPU build pins an earlier 5.x."""
    from transformers import TrainingArguments

    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    return {name: enabled}


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward, by the method's name in this transformers (see above)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()


def small_qwen3(hidden: int, layers: int, vocab: int, seed: int, **config: Any) -> torch.nn.Module:
    """A randomly initialised float32 Qwen3 of any small size, for stand-ins in tests and benches (tied
    embeddings, 64-wide heads, half as many KV heads, MLP 3x hidden, no BOS); `config` adds or overrides
    Qwen3Config fields (e.g. `head_dim`, `eos_token_id`, `tie_word_embeddings`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(2, hidden // 64)
    cfg = Qwen3Config(
        **{
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "head_dim": hidden // heads,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "pad_token_id": 0,
            **config,
        }
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def check_tokenizers(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> None:
    """Teacher and student must share vocabulary and special tokens, or token ids mean different things."""
    if student.get_vocab() != teacher.get_vocab():
        s, t = student.get_vocab(), teacher.get_vocab()
        diff = sorted(set(s.items()) ^ set(t.items()))[:3]
        raise TokenizerMismatch(
            f"teacher and student tokenizers differ ({len(s)} vs {len(t)} tokens; e.g. {diff}); "
            "white-box distillation needs a teacher with the student's tokenizer."
        )
    check_special_tokens(student, teacher)


def check_special_tokens(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> None:
    """`check_tokenizers` of two tokenizers known to share their vocabulary (`opd.crossteacher.differ` said
    so): only their special tokens compared."""
    for name in ("eos_token", "pad_token", "bos_token"):
        if getattr(student, name) != getattr(teacher, name):
            raise TokenizerMismatch(
                f"teacher and student disagree on {name}: {getattr(student, name)!r} vs "
                f"{getattr(teacher, name)!r}; use tokenizers with the same special tokens."
            )


def check_shared_vocab(teacher: PreTrainedTokenizerBase, proxy: PreTrainedTokenizerBase) -> None:
    """ADS adds the proxy's logits to the teacher's by token id: every ordinary token must have one id in
    both.

    Special and other added tokens may differ (DeepSeek-R1-Distill-Qwen renames Qwen2.5's), as the ADS
    reference allows.
    """
    if teacher is proxy:  # one tokenizer's files (`load_tokenizer`): one vocabulary
        return
    t, p = teacher.get_vocab(), proxy.get_vocab()
    if t == p:  # one vocabulary (Qwen3's sizes): nothing to look at token by token
        return
    special = {
        *teacher.all_special_tokens,
        *proxy.all_special_tokens,
        *teacher.get_added_vocab(),
        *proxy.get_added_vocab(),
    }
    wrong = sorted(k for k in set(t) & set(p) if k not in special and t[k] != p[k])
    only = sorted(k for k in set(t) ^ set(p) if k not in special)
    if wrong or only:
        raise ConfigError(
            f"the teacher's and proxy's tokenizers disagree on {len(wrong)} token ids (e.g. {wrong[:3]}) and "
            f"{len(only)} tokens exist in one only (e.g. {only[:3]}); ADS adds the proxy's logits to the "
            "teacher's by id, so choose a proxy that shares the teacher's tokenizer."
        )
