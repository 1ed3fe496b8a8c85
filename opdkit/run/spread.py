"""Work items spread over processes, one per GPU: each process holds its own models and runs its share of the
items one after another; every item keeps its result in its own folder, gathered afterwards (04's sweep
points).

    shares = assign(names, 4)                        # round-robin: item i runs in process i % 4
    rank, world = own_process()                      # in each launched process: one GPU of its own
    result = run_safely(folder / "point.json", lambda: work(item), {"name": name})  # or a failure, traceback

An item's result must not depend on the process it ran in (its seeds are its own), so N processes give what
one process gives. An item that raises is written down with its traceback (`error.txt`, and a failed result)
and its process goes on with the next item (CUDA's out-of-memory error included).
"""

from __future__ import annotations

import gc
import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

from opdkit.run.files import atomic_write_text

ERROR_FILE = "error.txt"  # beside a failed item's result: its traceback
# What notebook_launcher / torchrun set for torch.distributed: a process of its own trains its models alone,
# so transformers' Trainer must not see them (it would join the processes into one data-parallel run).
LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "NPROC",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FORK_LAUNCHED",
)


def assign(names: list[str], n: int) -> list[list[str]]:
    """Each process's items, by name: round-robin in order, so the split depends only on the list."""
    return [names[r::n] for r in range(n)]


def own_process() -> tuple[int, int]:
    """(rank, world size) of this process. With several, it keeps one GPU to itself (CUDA_VISIBLE_DEVICES, set
    before anything touches CUDA) and forgets the launcher's torch.distributed settings."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", rank))
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local % len(visible)] if visible else str(local)
        for key in LAUNCHER_ENV:
            os.environ.pop(key, None)
    return rank, world


def run_safely(
    result_file: Path, work: Callable[[], dict], failed: dict, recover: Callable[[], None] = lambda: None
) -> dict:
    """`work()`'s result with status done, kept in `result_file` (JSON); an exception becomes `failed` with
    status failed and its traceback (also in error.txt beside it), after `recover()` (e.g. models put
    back)."""
    folder = result_file.parent
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ERROR_FILE).unlink(missing_ok=True)
    try:
        result = {**work(), "status": "done"}
    except Exception:
        text = traceback.format_exc()
        atomic_write_text(folder / ERROR_FILE, text)
        result = {**failed, "status": "failed", "error": text}
        gc.collect()
        recover()
    atomic_write_text(result_file, json.dumps(result, indent=2))
    return result


def read_result(result_file: Path) -> dict | None:
    """An item's result, None when it never finished (nor failed)."""
    return json.loads(result_file.read_text()) if result_file.is_file() else None
