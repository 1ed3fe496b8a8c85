"""A teacher's output head (and final norm) read alone from its checkpoint, without its layers.

    head = load_head("Qwen/Qwen3-4B")          # or a local folder, or tiny:teacher
    head.weight_VH                              # (V, H): lm_head.weight, or the tied embedding
    head.norm_weight_H                          # the final RMSNorm's weight, or None (see `check_states`)

A teacher served elsewhere (`served.ServedTeacher`) sends its final hidden states; the divergence needs
only the head that turns them into logits, V x H numbers (1.6 GB of Qwen3-4B's 8 GB in bf16).

Pitfalls this module exists for:
- a tied head has no tensor of its own in the checkpoint: it is the input embedding, saved under that
  name (`model.embed_tokens.weight` in Qwen3); which names a head may have is asked of the architecture
  itself (an empty skeleton on the meta device), not written down per model family;
- a sharded checkpoint names the file holding each tensor in `model.safetensors.index.json`: only that
  file is opened (memory-mapped; only the head's bytes are read), and for a hub name only the index, the
  config and that one shard are downloaded;
- not every final norm is `weight * x / rms(x)` (Gemma's is `(1 + weight) * ...`, LayerNorm has a bias):
  the norm is run once on random input and used for the state check only where it has that form.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from opdkit import tiny

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class TeacherHead:
    """What a served teacher's trainer holds of it: the head, the final norm's weight, the config."""

    name: str
    config: PretrainedConfig
    weight_VH: torch.Tensor
    norm_weight_H: torch.Tensor | None  # None: the final norm is not a plain RMSNorm (no state check)
    source: str  # the file and tensor name the head came from

    @property
    def hidden_size(self) -> int:
        return self.weight_VH.shape[1]

    @property
    def rows(self) -> int:
        return self.weight_VH.shape[0]


def load_head(name: str, dtype: torch.dtype | None = None, revision: str | None = None) -> TeacherHead:
    """The output head of the model `name` (a local folder, `tiny:teacher`, or a hub name), read alone from
    its safetensors, in `dtype` (default: the checkpoint's)."""
    folder = tiny.resolve(name)
    config = AutoConfig.from_pretrained(folder, revision=revision)
    head_names, norm_name, norm = _names(config)
    files = _CheckpointFiles(folder, revision)
    head_key = next((k for k in head_names if files.has(k)), None)
    if head_key is None:
        raise FileNotFoundError(
            f"{name}'s checkpoint holds none of {head_names} (the names its architecture gives the output "
            "head); point at a folder with the model's safetensors, or a hub name that has them."
        )
    weight_VH = files.tensor(head_key)
    norm_weight_H = None
    if norm_name is not None and files.has(norm_name):
        norm_weight_H = files.tensor(norm_name)
        if not _is_plain_rms_norm(norm, norm_weight_H):
            norm_weight_H = None
    if dtype is not None:
        weight_VH = weight_VH.to(dtype)
    if weight_VH.shape[1] != config.hidden_size:
        raise ValueError(
            f"{name}: the head {head_key} is {tuple(weight_VH.shape)} but config.json says hidden_size "
            f"{config.hidden_size}; the checkpoint and its config do not belong together."
        )
    return TeacherHead(name, config, weight_VH, norm_weight_H, f"{files.file_of(head_key)}::{head_key}")


def _names(config: PretrainedConfig) -> tuple[list[str], str | None, torch.nn.Module | None]:
    """(the names under which the head's weight may be saved, the final norm's weight name, the norm
    module), from an empty skeleton of the architecture: tied weights are one parameter under two names."""
    from transformers import AutoModelForCausalLM  # seconds to import: not at the kit's import (a dry run)

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    head = skeleton.get_output_embeddings().weight
    if getattr(skeleton.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(
            f"{type(skeleton).__name__}'s output layer has a bias; a served teacher's logits are formed as "
            "hidden . W^T (bias-free heads only)."
        )
    names = [n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is head]
    if "lm_head.weight" in names:  # an untied head's own name first
        names.remove("lm_head.weight")
        names.insert(0, "lm_head.weight")
    norm = next(
        (
            getattr(skeleton.base_model, a)
            for a in ("norm", "final_layernorm", "ln_f")
            if hasattr(skeleton.base_model, a)
        ),
        None,
    )
    norm_name = None
    if norm is not None and getattr(norm, "weight", None) is not None:
        norm_name = next(n for n, p in skeleton.named_parameters(remove_duplicate=False) if p is norm.weight)
    return names, norm_name, norm


def _is_plain_rms_norm(norm: torch.nn.Module, weight_H: torch.Tensor) -> bool:
    """Whether `norm` with this weight computes weight * x / rms(x) (up to its epsilon): run it once."""
    module = copy.deepcopy(norm).to_empty(device="cpu").float()
    if len(list(module.parameters())) != 1 or len(list(module.buffers())) != 0:
        return False
    with torch.no_grad():
        module.weight.copy_(weight_H.float())
        x_NH = torch.randn(4, weight_H.shape[0], generator=torch.Generator().manual_seed(0))
        want_NH = weight_H.float() * x_NH * torch.rsqrt(x_NH.pow(2).mean(-1, keepdim=True))
        try:
            got_NH = module(x_NH)
        except Exception:  # a norm with another signature: no state check, nothing else depends on it
            return False
    return got_NH.shape == want_NH.shape and torch.allclose(got_NH, want_NH, rtol=1e-4, atol=1e-5)


class _CheckpointFiles:
    """The checkpoint's safetensors as name -> file, from a local folder or the hub (only the files a
    tensor asked for are downloaded)."""

    def __init__(self, folder: str, revision: str | None):
        self.folder, self.revision = folder, revision
        self.local = Path(folder).is_dir()
        index = self._fetch(INDEX_FILE, optional=True)
        if index is not None:
            self.weight_map: dict[str, str] | None = json.loads(Path(index).read_text())["weight_map"]
        else:
            self.weight_map = None
            single = self._fetch(SINGLE_FILE, optional=True)
            if single is None:
                raise FileNotFoundError(
                    f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; the teacher's head is read from "
                    "its safetensors (save the model with save_pretrained, safe_serialization on)."
                )
            self._single_keys = _keys(single)

    def file_of(self, key: str) -> str:
        return self.weight_map[key] if self.weight_map is not None else SINGLE_FILE

    def has(self, key: str) -> bool:
        return key in (self.weight_map if self.weight_map is not None else self._single_keys)

    def tensor(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._fetch(self.file_of(key))
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key)

    def _fetch(self, filename: str, optional: bool = False) -> str | None:
        if self.local:
            path = Path(self.folder) / filename
            return str(path) if path.is_file() else None
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return hf_hub_download(self.folder, filename, revision=self.revision)
        except EntryNotFoundError:
            if optional:
                return None
            raise


def _keys(path: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return set(f.keys())
