"""The saved proxy gradient as a file: grads.safetensors (fp32, the proxy's named_parameters() names, tied
weights once) and grads.json (proxy, tokenizer fingerprint, counts, norms), and the checks on load.

    save_grads(run.path, named, meta)
    g = load_grads(run.path, proxy, tokenizer)          # names, shapes and tokenizer checked
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from opdkit.ads.gradient import tensor_norms
from opdkit.config import ConfigError, MissingInput
from opdkit.run.files import atomic_path, atomic_write_text, json_safe

GRADS_FILE = "grads.safetensors"
META_FILE = "grads.json"
META_KEY = "opdkit"  # the safetensors header entry that holds the metadata, so the file describes itself


class GradsMismatch(ConfigError):
    """A saved gradient that does not belong to the model or tokenizer it is loaded for."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what makes token ids mean something: vocabulary, special tokens, chat template."""
    facts = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
        "eos": tokenizer.eos_token,
        "bos": tokenizer.bos_token,
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(facts, ensure_ascii=False).encode()).hexdigest()[:16]


def describe(named: dict[str, torch.Tensor], stats: dict, proxy_tokenizer: Any, **facts: Any) -> dict:
    """grads.json's record of a gradient: `facts` (which proxy, teacher and traces, normalization, world size,
    ...), the proxy tokenizer's fingerprint, the pass's `stats` (traces, tokens, loss, norm), the tensors'
    count, norms and shapes, the kit's version and the time."""
    import opdkit

    return {
        **facts,
        "tokenizer_fingerprint": tokenizer_fingerprint(proxy_tokenizer),
        **stats,
        "dtype": "float32",
        "num_tensors": len(named),
        "num_parameters": sum(g.numel() for g in named.values()),
        "opdkit_version": opdkit.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tensor_norms": tensor_norms(named),
        "tensor_shapes": {k: list(g.shape) for k, g in named.items()},
    }


def save_grads(directory: str | Path, named: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write `grads.safetensors` (fp32, metadata in its header) and `grads.json`, each atomically."""
    directory = Path(directory)
    path = directory / GRADS_FILE
    tensors = {name: g.detach().to("cpu", torch.float32).contiguous() for name, g in named.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(json_safe(meta))})
    atomic_write_text(directory / META_FILE, json.dumps(json_safe(meta), indent=2))
    return path


def _grads_path(path: str | Path) -> Path:
    path = Path(path)
    file = path / GRADS_FILE if path.is_dir() else path
    if not file.is_file():
        raise MissingInput(
            f"no saved gradient at {file}; expected the {GRADS_FILE} that savegrad writes in its run "
            "directory, so pass that run directory (or the file)."
        )
    return file


def check_grads(path: str | Path, model: torch.nn.Module, tokenizer: Any = None) -> dict:
    """Check a saved gradient against `model` (names, shapes) and `tokenizer` (fingerprint) without
    reading the tensors; returns its metadata. `model` may live on the meta device."""
    file = _grads_path(path)
    with safe_open(str(file), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    _check_names(file, shapes, expected, meta)
    wrong = [(k, shapes[k], expected[k]) for k in expected if shapes[k] != expected[k]]
    if wrong:
        k, got, want = wrong[0]
        raise GradsMismatch(
            f"{file} does not fit this model: {len(wrong)} tensor(s) have other shapes, e.g. {k} is {got} in "
            f"the file but {want} in the model; it was computed for "
            f"{meta.get('proxy_model', 'another model')}."
        )
    _check_fingerprint(file, meta, tokenizer if tokenizer is not None else _model_tokenizer(model))
    return meta


def _check_names(file: Path, shapes: dict, expected: dict, meta: dict) -> None:
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if not missing and not extra:
        return
    hint = ""
    if extra and all(k.startswith("module.") for k in extra):
        hint = " Its names carry DDP's `module.` prefix (the ADS seed's format); recompute it with savegrad."
    raise GradsMismatch(
        f"{file} does not fit this model: {len(missing)} parameter(s) have no gradient "
        f"(e.g. {missing[:2]}) and {len(extra)} gradient(s) match no parameter (e.g. {extra[:2]}); "
        "it was computed for "
        f"{meta.get('proxy_model', 'another model')}, so load the proxy it was computed for.{hint}"
    )


def _model_tokenizer(model: torch.nn.Module) -> Any:
    """The tokenizer stored next to a model loaded from a local folder; None when there is none."""
    folder = getattr(model, "name_or_path", "") or getattr(
        getattr(model, "config", None), "_name_or_path", ""
    )
    if not folder or not Path(folder).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None


def _check_fingerprint(file: Path, meta: dict, tokenizer: Any) -> None:
    if tokenizer is None:
        import warnings

        warnings.warn(f"tokenizer not checked against {file}: pass tokenizer= to load_grads.", stacklevel=3)
        return
    got, want = tokenizer_fingerprint(tokenizer), meta.get("tokenizer_fingerprint")
    if got != want:
        raise GradsMismatch(
            f"{file} was computed with another tokenizer (fingerprint {want}, this one {got}); token ids "
            "would mean different things, so use the tokenizer of "
            f"{meta.get('proxy_model', 'the proxy it was computed for')}."
        )


def load_grads(
    path: str | Path, model: torch.nn.Module, tokenizer: Any = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The saved gradient as {parameter name: fp32 tensor}, after `check_grads` against model and tokenizer.

    Without `tokenizer`, the one saved next to the model's local folder is used (else only warned about).
    """
    check_grads(path, model, tokenizer)
    with safe_open(str(_grads_path(path)), framework="pt", device=str(device)) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_meta(path: str | Path) -> dict:
    """The metadata of a saved gradient (the grads.json next to it, or the file's header)."""
    file = _grads_path(path)
    side = file.with_name(META_FILE)
    if side.is_file():
        return json.loads(side.read_text())
    with safe_open(str(file), framework="pt") as f:
        return json.loads((f.metadata() or {}).get(META_KEY, "{}"))
