"""Trainer checkpoints of a run folder: which one a resumed run continues from.

    last = resume_checkpoint(run.path / "checkpoints")     # the newest complete checkpoint-N, or None
    trainer.train(resume_from_checkpoint=str(last) if last else None)

transformers writes `checkpoint-N` in place, weights first and `trainer_state.json` last, so a run killed
while saving leaves a half-written newest checkpoint beside a complete older one. Resuming from it fails
(a `SafetensorError`) or, worse, starts from half a state. A checkpoint is complete when its
`trainer_state.json` reads as JSON, its weights are whole (a safetensors file holds every byte its header
promises, an index's shards are all there) and its torch files (weights, optimizer, scheduler, RNG states)
are whole zip archives. `resume_checkpoint` takes the newest complete one and removes each incomplete
one, saying which and why: a half-written folder would otherwise count against `save_total_limit` when the
Trainer rotates checkpoints, and mix its stale files into the save that rewrites `checkpoint-N`.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

from opdkit.run.folders import print0, rank

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
# Weights as transformers and peft save them: one file, or an index naming its shards.
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# torch.save files: optimizer.pt, scheduler.pt, rng_state*.pth, scaler.pt; under FSDP optimizer.bin and
# pytorch_model_fsdp.bin; training_args.bin.
TORCH_FILES = ("*.pt", "*.pth", "*.bin")


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


def safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be loaded (its header unreadable, or fewer bytes than the header
    promises: a write cut short); None when it is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                return f"{path.name} is {size} bytes, shorter than a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                return f"{path.name} is cut inside its header ({size} of {8 + n} bytes)"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as exc:
        return f"{path.name} has no readable safetensors header ({exc})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path.name} holds {size} bytes where its header promises {8 + n + end} (a write cut short)"
    return None


def torch_file_problem(path: Path) -> str | None:
    """Why a `torch.save` file cannot be loaded: not a whole zip archive (a write cut short)."""
    try:
        with zipfile.ZipFile(path) as zf:
            zf.infolist()
    except (OSError, zipfile.BadZipFile) as exc:
        return f"{path.name} is not a whole torch archive ({exc})"
    return None


def _weights_problem(folder: Path) -> str | None:
    names: list[str] = [n for n in WEIGHT_FILES if (folder / n).is_file()]
    for index in WEIGHT_INDEXES:
        if (folder / index).is_file():
            try:
                names += sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError) as exc:
                return f"{index} is unreadable ({exc})"
    if not names:
        return f"no weights (none of {', '.join(WEIGHT_FILES + WEIGHT_INDEXES)})"
    for name in names:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        problem = safetensors_problem(path) if name.endswith(".safetensors") else torch_file_problem(path)
        if problem:
            return problem
    return None


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why `folder` is not a complete Trainer checkpoint to resume from; None when it is one."""
    folder = Path(folder)
    try:
        state = folder / STATE_FILE
        if not state.is_file():
            return f"no {STATE_FILE}: transformers writes it last, so the save was cut short"
        try:
            json.loads(state.read_text())["global_step"]
        except (ValueError, KeyError) as exc:
            return f"{STATE_FILE} is unreadable ({exc!r})"
        problem = _weights_problem(folder)
        if problem:
            return problem
        for path in sorted(p for pattern in TORCH_FILES for p in folder.glob(pattern)):
            problem = torch_file_problem(path)
            if problem:
                return problem
    except OSError as exc:  # another process removing it while we look
        return f"unreadable ({exc})"
    return None


def resume_checkpoint(folder: str | Path, say: Callable[[str], None] = print0) -> Path | None:
    """The newest complete checkpoint in `folder` (a Trainer's output_dir), None when it holds none. Every
    incomplete checkpoint is reported through `say` with the reason, and removed (by rank 0 only; the
    other ranks of a launched run find the same complete one)."""
    found = None
    for path in reversed(checkpoints(folder)):
        problem = checkpoint_problem(path)
        if problem is None:
            found = found or path
            continue
        say(f"resume: skipping {path} ({problem}); it is removed")
        if rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
    if found is not None:
        say(f"resume: continuing from {found}")
    elif Path(folder).is_dir():
        say(f"resume: no complete checkpoint in {folder}; training starts from the beginning")
    return found
