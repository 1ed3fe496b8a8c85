"""Trainer checkpoints of a run folder: which one a resumed run continues from.

    last = resume_checkpoint(trainer.args.output_dir, trainer_layout(trainer))   # newest complete, or None
    trainer.train(resume_from_checkpoint=str(last) if last else None)

Pitfalls this module exists for:
- transformers resumes from whatever a checkpoint holds: without `optimizer.pt` and `scheduler.pt` it goes
  on with fresh AdamW moments and a restarted schedule, without an RNG file with other random numbers, and
  says so in a log line at most. So a checkpoint is complete only with every file its trainer writes
  (`Layout`, from `trainer_layout`: weights, optimizer, scheduler, scaler, each process's RNG state,
  `training_args.bin`, `trainer_state.json`), each of them whole; a missing one is named.
- transformers writes `checkpoint-N` in place, weights first and `trainer_state.json` last (process 0 writes
  it; another process's RNG file may land after it), so a run killed while saving leaves a half-written
  newest checkpoint. Only one *proven* partial is removed: no `trainer_state.json`, or one that is not JSON,
  or a file shorter than its format promises (a write cut short). It would count against `save_total_limit`
  and mix its stale files into the save that rewrites `checkpoint-N`. One that merely lacks a file may have
  been written with other settings (another process count, `save_only_model`): it is moved aside to
  `incomplete-checkpoint-N` (out of the Trainer's rotation and of the next save's way), never deleted.
- an `OSError` while reading (a lost mount, permissions, a file vanishing) proves nothing about a
  checkpoint: resume stops with `CheckpointUnreadable`, naming the path, and removes nothing.
- under torch.distributed, process 0 alone reads, removes and chooses, and every process takes its choice
  (`broadcast_object_list`): a process that saw the files differently would resume from another step.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opdkit.config import RunFailure
from opdkit.run.folders import print0, rank

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
ASIDE_PREFIX = "incomplete-"  # a checkpoint set aside: the Trainer's rotation globs `checkpoint-*` only
STATE_FILE = "trainer_state.json"
# Weights as transformers and peft save them: one file, or an index naming its shards.
MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
MODEL_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


class CheckpointUnreadable(RunFailure, OSError):
    """A checkpoint could not be read (an OSError): nothing is known about it, so nothing was removed."""


@dataclass(frozen=True)
class Layout:
    """The files a trainer writes into every `checkpoint-N` (transformers 5's `Trainer._save_checkpoint`):
    its weights (any one of `weights()`, an index with all its shards) and every one of `files()`."""

    processes: int = 1  # RNG states: rng_state.pth in one process, else rng_state_{k}.pth for each process k
    adapter: bool = False  # a peft model saves its adapter (adapter_model.safetensors + its config)
    fsdp: bool = (
        False  # FSDP with a full state dict: pytorch_model_fsdp.bin beside the weights, optimizer.bin
    )
    model_only: bool = False  # save_only_model: no optimizer, scheduler, scaler or RNG states
    scaler: bool = False  # fp16's gradient scaler: scaler.pt

    def weights(self) -> tuple[str, ...]:
        return ADAPTER_WEIGHTS if self.adapter else MODEL_WEIGHTS + MODEL_INDEXES

    def files(self) -> list[str]:
        files = ["training_args.bin"] + (["adapter_config.json"] if self.adapter else [])
        if not self.model_only:
            # FSDP saves its own copy of the weights beside its optimizer state, and resumes from that copy
            files += ["pytorch_model_fsdp.bin", "optimizer.bin"] if self.fsdp else ["optimizer.pt"]
            files += ["scheduler.pt"]
            files += ["scaler.pt"] if self.scaler else []
            one = self.processes <= 1
            files += ["rng_state.pth"] if one else [f"rng_state_{k}.pth" for k in range(self.processes)]
        return files + [STATE_FILE]


def trainer_layout(trainer: Any) -> Layout:
    """The `Layout` of a built transformers `Trainer` (its arguments, its accelerator, its model)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        kind = str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
        if "FULL_STATE_DICT" not in kind:
            raise ValueError(
                f"resume knows FSDP checkpoints saved with a full state dict only, not {kind}; set "
                "fsdp_config's state_dict_type to FULL_STATE_DICT (opdkit's sharding.FSDP_CONFIG does)"
            )
    return Layout(
        processes=trainer.args.world_size,
        adapter=getattr(trainer.model, "peft_config", None) is not None,  # peft's PeftModel
        fsdp=bool(getattr(trainer, "is_fsdp_enabled", False)),
        model_only=bool(trainer.args.save_only_model),
        scaler=getattr(trainer.accelerator, "scaler", None) is not None,
    )


def checkpoint_step(path: str | Path) -> int:
    """N of a `checkpoint-N` folder."""
    m = CHECKPOINT.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint-N folder.")
    return int(m.group(1))


def checkpoints(folder: str | Path) -> list[Path]:
    """The `checkpoint-N` folders in `folder`, oldest step first; none when `folder` does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        (p for p in folder.iterdir() if CHECKPOINT.match(p.name) and p.is_dir()), key=checkpoint_step
    )


@dataclass(frozen=True)
class Problem:
    """Why a checkpoint cannot be resumed from; `partial`: proven cut short (a save that did not finish)."""

    reason: str
    partial: bool


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be loaded (a header that is not one, or fewer bytes than the header
    promises: a write cut short); None when it is whole. An OSError propagates."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            return f"{path.name} is {size} bytes, shorter than a safetensors header"
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            return f"{path.name} is cut inside its header ({size} of {8 + n} bytes)"
        try:
            header = json.loads(fh.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            return f"{path.name} has no readable safetensors header ({exc!r})"
    if 8 + n + end != size:
        return f"{path.name} holds {size} bytes where its header promises {8 + n + end} (a write cut short)"
    return None


def torch_file_problem(path: Path) -> str | None:
    """Why a `torch.save` file cannot be loaded: not a whole zip archive (a write cut short). An OSError
    propagates."""
    try:
        with zipfile.ZipFile(path) as zf:
            zf.infolist()
    except zipfile.BadZipFile as exc:
        return f"{path.name} is not a whole torch archive ({exc})"
    return None


def _file_problem(path: Path) -> str | None:
    if path.suffix == ".safetensors":
        return safetensors_problem(path)
    if path.suffix == ".json":
        try:
            json.loads(path.read_text())
        except ValueError as exc:
            return f"{path.name} is not whole JSON ({exc})"
        return None
    return torch_file_problem(path)


def _weight_files(folder: Path, names: set[str], layout: Layout) -> list[str] | Problem:
    """The weight files the checkpoint's weights consist of, or why there are none."""
    for name in layout.weights():
        if name not in names:
            continue
        if not name.endswith(".index.json"):
            return [name]
        try:
            return sorted(set(json.loads((folder / name).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return Problem(f"{name} is not a whole index ({exc!r})", partial=True)
    return Problem(f"no weights (none of {', '.join(layout.weights())})", partial=False)


def checkpoint_problem(folder: str | Path, layout: Layout) -> Problem | None:
    """Why `folder` is not a complete checkpoint of `layout`; None when it is one. Raises CheckpointUnreadable
    on an OSError (then nothing is known about it)."""
    folder = Path(folder)
    try:
        names = {p.name for p in folder.iterdir()}
        if STATE_FILE not in names:
            return Problem(f"no {STATE_FILE}: transformers writes it last, so the save was cut short", True)
        try:
            json.loads((folder / STATE_FILE).read_text())["global_step"]
        except (ValueError, KeyError, TypeError) as exc:
            return Problem(f"{STATE_FILE} is not whole ({exc!r}): the save was cut short", True)
        weights = _weight_files(folder, names, layout)
        if isinstance(weights, Problem):
            return weights
        missing = [n for n in weights + layout.files() if n not in names]
        if missing:
            return Problem(
                f"no {', '.join(missing)}, which this run's trainer writes in every checkpoint", False
            )
        for name in weights + [n for n in layout.files() if n != STATE_FILE]:
            problem = _file_problem(folder / name)
            if problem:
                return Problem(problem, partial=True)
    except OSError as exc:
        raise _unreadable(folder, exc) from exc
    return None


def _unreadable(path: Path, exc: OSError) -> CheckpointUnreadable:
    return CheckpointUnreadable(
        f"resume: cannot read {path} ({exc}); nothing was removed. Fix the file system (permissions, a lost "
        f"mount) and resume again, or move {path} out of {path.parent} to resume from an older checkpoint."
    )


def _set_aside(path: Path) -> Path:
    target, k = path.with_name(ASIDE_PREFIX + path.name), 2
    while target.exists():
        target, k = path.with_name(f"{ASIDE_PREFIX}{path.name}.{k}"), k + 1
    path.rename(target)
    return target


def choose_checkpoint(
    folder: str | Path, layout: Layout, say: Callable[[str], None] = print0, tidy: bool = True
) -> Path | None:
    """The newest complete checkpoint of `layout` in `folder`, looked at by this process alone. Each newer
    one is said with its reason and, with `tidy`, removed when proven partial or moved aside when it lacks
    a file. Raises CheckpointUnreadable on an OSError, before removing or moving anything."""
    found, skipped = None, []
    try:
        candidates = checkpoints(folder)
    except OSError as exc:
        raise _unreadable(Path(folder), exc) from exc
    for path in reversed(candidates):
        problem = checkpoint_problem(path, layout)
        if problem is None:
            found = path
            break
        skipped.append((path, problem))
    for path, problem in skipped:
        if not tidy:
            say(f"resume: skipping {path} ({problem.reason})")
        elif problem.partial:
            say(f"resume: skipping {path} ({problem.reason}); it is removed")
            shutil.rmtree(path)
        else:
            aside = _set_aside(path)
            say(
                f"resume: skipping {path} ({problem.reason}); moved aside to {aside.name}, kept: rename it "
                "back to resume from it with the settings it was written with"
            )
    if found is not None:
        say(f"resume: continuing from {found}")
    elif Path(folder).is_dir():
        say(f"resume: no complete checkpoint in {folder}; training starts from the beginning")
    return found


def resume_checkpoint(folder: str | Path, layout: Layout, say: Callable[[str], None] = print0) -> Path | None:
    """The newest complete checkpoint of `layout` in `folder` (a Trainer's output_dir), None when it holds
    none (`choose_checkpoint`). Under torch.distributed process 0 chooses and tidies, and every process
    returns its choice, or raises its CheckpointUnreadable; without it (one process, or processes that do
    not share a process group) each chooses alone and only rank 0 tidies."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return choose_checkpoint(folder, layout, say, tidy=rank() == 0)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            found = choose_checkpoint(folder, layout, say)
            box[0] = ("found", None if found is None else str(found))
        except BaseException as exc:  # the other processes wait in the broadcast: tell them, then raise
            box[0] = ("unreadable" if isinstance(exc, CheckpointUnreadable) else "failed", str(exc))
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "unreadable":
        raise CheckpointUnreadable(value)
    if kind == "failed":
        raise RuntimeError(f"resume: process 0 failed while choosing a checkpoint in {folder}: {value}")
    return None if value is None else Path(value)
