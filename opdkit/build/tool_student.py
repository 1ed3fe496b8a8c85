"""The recipe that builds `tiny:student-tools`: the tiny student taught the chat-with-tools format on another
task, as a real instruct student knows it before anyone distils tool use into it.

    python -m opdkit.build.tool_student --out opdkit/tiny/assets/student-tools      # about a minute, 1 core

The other task is looking a code up with a `lookup` tool: the system block lists `lookup(key)`, the user
writes `code 312-977+583`, the assistant calls `lookup` on `312-977+583`, the tool answers a number the
student cannot work out (`lookup_value`, a CRC of the key: `3343`), the assistant answers `;3343`.
Completion-only SFT (`tiny_world.sft_until`, the kit's one SFT loop) from the shipped `tiny:student` on those
transcripts, the loss on the assistant's two turns (`tool_teacher.transcript_row`). The student so
knows how a call is written and that a result is copied into the answer, but has never seen the calculator:
on the tiny tool world's sums (`opdkit.tasks.tinytools`, the calculator listed) it calls `lookup` or writes
its scratchpad, and answers 0 % of them (`recipe.json`'s `tiny_tools_heldout`). Notebook 05's demo preset
distils the calculator into it (`params/whitebox/tiny-tools-demo.yaml`): which tool to call, its argument's
name, and to copy the sum's result.

No environment plays the `lookup` tool: its transcripts are rendered for SFT only, the tool's answer
computed here (`lookup_messages`). A first recipe used a `reverse` tool; its student learned to write the
answer from the prompt (the reversed text) instead of copying the tool's result, and so could not copy a sum.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import zlib
from pathlib import Path

import torch

from opdkit import models
from opdkit.build import tiny_world as build
from opdkit.build.tool_teacher import greedy_turn, heldout_figures, transcript_row
from opdkit.tasks import tinytools
from opdkit.tasks.base import Messages

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The number filed under a key.",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "description": "the key, e.g. 312-977+583"}},
            "required": ["key"],
        },
    },
}
TOOLS = [LOOKUP]
EVAL_SEED = 778  # the build's own evaluation stream


def lookup_key(rng: random.Random) -> str:
    """Four 3-digit numbers joined by + or -: a key as long as a tiny-tools sum's expression, written with
    its characters (copying it into a call is the skill the calculator needs too)."""
    numbers = [str(rng.randint(100, 999)) for _ in range(4)]
    return "".join(n + rng.choice("+-") for n in numbers)[:-1]


def lookup_value(key: str) -> str:
    """The number filed under `key`: 400 to 3999 as a tiny-tools sum, from a CRC (nothing to work out)."""
    return str(400 + zlib.crc32(key.encode()) % 3600)


def lookup_messages(key: str) -> Messages:
    """The other task's transcript: the prompt, `lookup` called on the key, its result, the answer."""
    call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
    value = lookup_value(key)
    return [
        {"role": "user", "content": key},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": tinytools.ANSWER_SEP + value},
    ]


class LookupRows(torch.utils.data.Dataset):
    """SFT rows of `lookup` transcripts, `n` keys drawn from `seed`, rendered with `lookup` listed."""

    def __init__(self, tokenizer, n: int, seed: int):
        rng = random.Random(seed)
        self.tokenizer, self.keys = tokenizer, [lookup_key(rng) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> dict:
        return transcript_row(self.tokenizer, lookup_messages(self.keys[i]), TOOLS)


def lookup_accuracy(model, tokenizer, n: int = 200) -> float:
    """The share of `n` held-out keys whose two greedy turns are both the transcript's: the call as written,
    and, after the tool's result, the answer that copies it."""
    rng = random.Random(EVAL_SEED)
    transcripts = [lookup_messages(lookup_key(rng)) for _ in range(n)]

    def turn(upto: int) -> list[bool]:
        want = [
            tokenizer.apply_chat_template(t[: upto + 1], tools=TOOLS, tokenize=False) for t in transcripts
        ]
        prompts = [tokenizer.apply_chat_template(t[:upto], tools=TOOLS, tokenize=False) for t in transcripts]
        got = greedy_turn(model, tokenizer, [t[:upto] for t in transcripts], tinytools.MAX_TURN_TOKENS, TOOLS)
        return [
            g.strip() != ""
            and w.startswith(p + "<|im_start|>assistant\n" + g.strip())
            and w[len(p) + len("<|im_start|>assistant\n") + len(g.strip()) :].startswith("<|im_end|>")
            for g, w, p in zip(got, want, prompts)
        ]

    was_training = model.training
    model.eval()
    right = [c and a for c, a in zip(turn(1), turn(3))]
    model.train(was_training)
    return sum(right) / n


def build_tool_student(out: str | Path, *, steps: int = 1200, seed: int = 0) -> dict:
    """Teach `tiny:student` the `lookup` tool's transcripts and save it into `out`; returns `recipe.json`."""
    out, t0 = Path(out), time.time()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = models.load_tokenizer("tiny:student")
    student = models.load_model("tiny:student")
    history = build.sft_until(
        student,
        tokenizer,
        LookupRows(tokenizer, steps * 64, seed),
        steps=steps,
        lr=3e-3,
        batch_size=64,
        seed=seed + 13,
        eval_every=50,
        evaluate=lambda: lookup_accuracy(student, tokenizer),
        stop_when=lambda acc: acc >= 0.98,
        desc="student-tools",
    )
    student.save_pretrained(out)
    tokenizer.save_pretrained(out)
    rec = {
        "task": "a code looked up with a lookup tool (opdkit.build.tool_student), from tiny:student",
        "seed": seed,
        "history": history,
        "lookup_accuracy": lookup_accuracy(student, tokenizer, 500),
        "tiny_tools_heldout": heldout_figures(student, tokenizer, n=200),
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "recipe.json").write_text(json.dumps(rec, indent=2))
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write the student and its tokenizer into")
    p.add_argument("--steps", type=int, default=1200, help="at most; stops at 98 %% of the build's own keys")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rec = build_tool_student(a.out, steps=a.steps, seed=a.seed)
    print(json.dumps({k: v for k, v in rec.items() if k != "history"}, indent=2))


if __name__ == "__main__":
    main()
