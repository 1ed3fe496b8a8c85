"""The tiny world: a synthetic task, a character tokenizer, and a tiny teacher and student.

`tiny:teacher`, `tiny:student` and `tiny:tokenizer` name the folders shipped in `assets/`; they load
through `AutoModelForCausalLM` / `AutoTokenizer` like any Hugging Face model. `build.py` rebuilds them.
"""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
PREFIX = "tiny:"


def resolve(name: str) -> str:
    """`tiny:<part>` becomes the shipped folder; any other name (a path or hub id) is returned as is."""
    if not name.startswith(PREFIX):
        return name
    part = name[len(PREFIX) :]
    path = ASSETS / part
    if not (path / "config.json").exists() and not (path / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"{name!r} is not part of the shipped tiny world (expected {path}); valid: tiny:teacher, "
            "tiny:student, tiny:tokenizer. Rebuild with `python -m opdkit.tiny.build --out "
            f"{ASSETS}` if the folder was deleted."
        )
    return str(path)
