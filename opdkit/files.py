"""Small file helpers every room uses: atomic writes and JSON that survives NaN.

atomic_write_text(path, text)        # readers see the old file or the new one, never half of it
write_jsonl(path, records); read_jsonl(path)
"""

from __future__ import annotations

import json
import math
import os
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


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_jsonl(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(json_safe(r)) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    path = Path(path)
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )
