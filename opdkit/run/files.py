"""Small file helpers every room uses: atomic writes and JSON that survives NaN.

atomic_write_text(path, text)        # readers see the old file or the new one, never half of it
with atomic_path(path) as tmp: save(tmp)   # the same for anything written to a path (a file or a folder)
write_jsonl(path, records); read_jsonl(path)
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def json_safe(value: Any) -> Any:
    """Floats that JSON cannot hold (nan, inf) become None; tensors and numpy scalars become numbers."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write a file or folder to; it replaces `path` when the block ends
    without an error and is removed otherwise, so readers see the old `path` or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_jsonl(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(json_safe(r)) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
