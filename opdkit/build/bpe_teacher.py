"""The tiny teacher again, on the byte-level BPE tokenizer (`opdkit.tiny.bpe`): a teacher whose tokenizer
differs from the tiny student's, built with the tiny world's own recipe (`opdkit.build.tiny_world`).

    python -m opdkit.build.bpe_teacher --out opdkit/tiny/assets/teacher-bpe     # `tiny:teacher-bpe`

Same architecture, optimiser, data stream and stopping rule as the shipped teacher; only the tokenizer
(and so the embedding's rows) differs. Writes the model, its tokenizer and `recipe.json` (held-out
accuracy, build time) into one folder.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from opdkit.build import tiny_world as build
from opdkit.tiny.bpe import build_bpe_tokenizer


def build_bpe_teacher(
    out: str | Path, *, steps: int = 6000, stop_accuracy: float = 0.995, eval_every: int = 250, seed: int = 0
) -> dict:
    """Train and save the teacher into `out`; returns what `recipe.json` records."""
    out, t0 = Path(out), time.time()
    tokenizer = build_bpe_tokenizer()
    teacher = build.qwen3_model(build.TEACHER, tokenizer, seed)
    history = build.train_on_task(
        teacher,
        tokenizer,
        steps=steps,
        lr=3e-3,
        batch_size=64,
        seed=seed + 1,
        eval_every=eval_every,
        stop_when=lambda acc: acc >= stop_accuracy,
        desc="teacher-bpe",
    )
    teacher.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {
        "task": "3-digit addition with a column scratchpad (opdkit.tasks.tiny)",
        "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens (opdkit.tiny.bpe)",
        "seed": seed,
        "teacher": {**asdict(build.TEACHER), "params": teacher.num_parameters(), "history": history},
        "teacher_heldout_accuracy": build.heldout_accuracy(teacher, tokenizer),
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "recipe.json").write_text(json.dumps(record, indent=2))
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write the teacher and its tokenizer into")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rec = build_bpe_teacher(a.out, steps=a.steps, seed=a.seed)
    print(json.dumps({k: v for k, v in rec.items() if k != "teacher"}, indent=2))


if __name__ == "__main__":
    main()
