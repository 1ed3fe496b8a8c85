"""The tiny world as shipped: a character tokenizer, and a tiny teacher and student (its task, 3-digit
addition, is `opdkit.tasks.tiny`).

`tiny:teacher`, `tiny:student` and `tiny:tokenizer` name the folders shipped in `assets/`; they load
through `AutoModelForCausalLM` / `AutoTokenizer` like any Hugging Face model. `opdkit.build.tiny_world`
rebuilds them. `tiny:teacher-bpe` is a teacher on a byte-level BPE tokenizer instead (the tiny world
across tokenizers; `opdkit.build.bpe_teacher` rebuilds it). `tiny:teacher-tools` is the tiny tool
world's teacher (sums of four 3-digit numbers with a calculator, `opdkit.tasks.tinytools`), on the student's
tokenizer; `opdkit.build.tool_teacher` rebuilds it, and with `--tokenizer bpe` `tiny:teacher-bpe-tools`, the
same teacher on teacher-bpe's tokenizer (the tool world across tokenizers).
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
            "tiny:student, tiny:tokenizer, tiny:teacher-bpe, tiny:teacher-tools, tiny:teacher-bpe-tools. "
            "Rebuild "
            f"with `python -m opdkit.build.tiny_world --out {ASSETS}` (or `opdkit.build.bpe_teacher` for "
            "teacher-bpe, `opdkit.build.tool_teacher` for teacher-tools, with `--tokenizer bpe` for "
            "teacher-bpe-tools) if the folder was deleted."
        )
    return str(path)
