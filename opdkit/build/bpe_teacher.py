"""The tiny teacher again, on a byte-level BPE tokenizer: a teacher that cuts text differently from the tiny
student, built with the tiny world's own recipe (`opdkit.build.tiny_world`).

    python -m opdkit.build.bpe_teacher --out opdkit/tiny/assets/teacher-bpe    # `tiny:teacher-bpe`
    tok = build_bpe_tokenizer()          # deterministic: trained on a fixed stream of tiny-task conversations

The tiny world's own tokenizer has one token per character; this one is byte-level BPE (GPT-2's byte
alphabet, so any text encodes, as Qwen's and DeepSeek's do) with merges learned from the task's text and chat
template, and digits one a token, as Qwen's and Llama's tokenizers cut them (digits merged in pairs, "358" as
"35" "8", break the column-by-column scratchpad: such a teacher stayed under 95 % after 1,800 steps). Two
ways to cut the rest (`--pieces`):

- digits (the default, `tiny:teacher-bpe`): GPT-2's pieces with digits apart, so the task's text is one
  character a token as for the student, in other token ids, while the chat template's words are merged
  ("assistant" one token where the student reads nine);
- symbol-digit: each digit carries the symbols before it, as GPT-2's words carry the space before them, so
  "=15," is "=1" "5" "," where the student reads "=" "1" "5" ",": multi-token groups in every completion.
  GOLD's losses cannot teach across these: the hybrid's JSD pairs tokens spelled alike, so it pushes down the
  student's "5" after "," where the teacher's mass is on ",5", and ULD's sorted L1 matches probabilities
  rank by rank, never which token (in a tiny run with either, the student fell from 20.6 % to 0 % by step
  50).

With the same Qwen-style chat template and special tokens as the character tokenizer, a teacher trained on
it reads the same conversations in other tokens, which is what distilling across tokenizers
(`opdkit.opd.teachers.cross`) needs to be tried on a CPU. Same architecture, optimiser and data stream as the
shipped teacher, stopping at `--stop-accuracy` held-out; only the tokenizer (and so the embedding's rows)
differs. Writes the model, its tokenizer and `recipe.json` (held-out accuracy, build time) into one folder;
`recipe.json` holds the accuracy history while it trains.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from opdkit.build import tiny_world as build
from opdkit.tasks import tiny as task
from opdkit.tiny import tokenizer as tiny_tokenizer
from opdkit.tiny.tokenizer import SPECIALS

VOCAB_SIZE = 400  # at most: 256 bytes, 5 special tokens and the merges
DIGIT_PIECE = r"[^0-9]*[0-9]"  # a pre-tokenizer piece: one digit and the non-digits before it


def corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Text the merges are learned from: the role names and `n` prompts with one of their scratchpads."""
    rng = random.Random(seed)
    lines = ["system", "user", "assistant"]
    for _ in range(n):
        problem = task.sample_problem(rng)
        lines += [problem.prompt, task.scratchpad(problem, rng)]
    return lines


def build_bpe_tokenizer(vocab_size: int = VOCAB_SIZE, pieces: str = "digits") -> PreTrainedTokenizerFast:
    """`pieces`: digits (each digit, each run of symbols and each word its own piece, GPT-2's rule with
    digits one a token: the task's text is one character a token, the chat template's words merged) or
    symbol-digit (each digit with the symbols before it: "=15," is "=1" "5" ",")."""
    core = Tokenizer(models.BPE())
    if pieces == "digits":
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pieces == "symbol-digit":
        core.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(DIGIT_PIECE), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise ValueError(f"pieces={pieces!r}: digits or symbol-digit")
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus(), trainer=trainer)
    return tiny_tokenizer.wrap(core)


def build_bpe_teacher(
    out: str | Path,
    *,
    steps: int = 6000,
    stop_accuracy: float = 0.95,
    eval_every: int = 250,
    seed: int = 0,
    pieces: str = "digits",
) -> dict:
    """Train and save the teacher into `out`; returns what `recipe.json` records."""
    out, t0 = Path(out), time.time()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_bpe_tokenizer(pieces=pieces)
    teacher = build.qwen3_model(build.TEACHER, tokenizer, seed)

    def record(history: list[dict], **more) -> dict:
        rec = {
            "task": "3-digit addition with a column scratchpad (opdkit.tasks.tiny)",
            "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens, {pieces} pieces (build.bpe_teacher)",
            "seed": seed,
            "stop_accuracy": stop_accuracy,
            "teacher": {**asdict(build.TEACHER), "params": teacher.num_parameters(), "history": history},
            **more,
        }
        (out / "recipe.json").write_text(json.dumps(rec, indent=2))
        return rec

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
        on_record=record,
    )
    teacher.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return record(
        history,
        teacher_heldout_accuracy=build.heldout_accuracy(teacher, tokenizer),
        build_seconds=round(time.time() - t0, 1),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write the teacher and its tokenizer into")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--stop-accuracy", type=float, default=0.95, help="stop once held-out accuracy reaches it")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pieces", default="digits", choices=("digits", "symbol-digit"), help="pre-tokenizer")
    a = p.parse_args()
    rec = build_bpe_teacher(
        a.out,
        steps=a.steps,
        stop_accuracy=a.stop_accuracy,
        eval_every=a.eval_every,
        seed=a.seed,
        pieces=a.pieces,
    )
    print(json.dumps({k: v for k, v in rec.items() if k != "teacher"}, indent=2))


if __name__ == "__main__":
    main()
