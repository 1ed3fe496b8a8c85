"""The recipe that builds the tiny tool world's teacher, `tiny:teacher-tools`: a tiny Qwen3 that answers a sum
of four 3-digit numbers by calling the calculator and copying its result (`opdkit.tasks.tinytools`).

    python -m opdkit.build.tool_teacher --out opdkit/tiny/assets/teacher-tools       # a few minutes, 1 core
    python -m opdkit.build.tool_teacher --out opdkit/tiny/assets/teacher-bpe-tools --tokenizer bpe

Trained from scratch by the kit's one SFT loop (`opdkit.sft.trainer`, as `opdkit.build.tiny_world`) on
transcripts rendered by the tiny chat template with the calculator listed (`tools=[CALCULATOR]`): the prompt,
the assistant's call, the tool's result, the assistant's answer; the loss is on the assistant's two turns only
(the call and the answer), never on the tool's result. Same tokenizer as the tiny student, so the two can be
distilled in process; with `--tokenizer bpe` (`tiny:teacher-bpe-tools`) the byte-level BPE tokenizer of
`opdkit.build.bpe_teacher` instead (same template, other tokens: a teacher with another tokenizer). Measured
with the tool (`tool_accuracy`): greedy episodes against the calculator's environment
(`tasks.evaluate.episode_accuracy`: the call parsed and answered by `calculate`, no `eval` of model text, the
result appended as a tool turn, greedy answer, graded). Writes the model, its tokenizer and `recipe.json`
(held-out accuracy with the tool, the shipped student's without it, build time) into one folder.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opdkit import models
from opdkit.build import bpe_teacher
from opdkit.build import tiny_world as build
from opdkit.data.labels import IGNORE
from opdkit.rollout import engines, sampling
from opdkit.tasks import tinytools as task
from opdkit.tasks.calculator import CalculatorEnvironment
from opdkit.tasks.evaluate import episode_accuracy
from opdkit.tiny.tokenizer import build_tokenizer

# The tiny student's shape: copying the expression into the call and the result into the answer needs no
# more (and a small teacher builds in minutes on one core).
TEACHER = build.ModelSpec(64, 2, 2, 1, 192, 32)
EVAL_SEED = 777  # the build's own evaluation stream (not the held-out pool)
TOKENIZERS = {  # --tokenizer: how to build it, what recipe.json says
    "char": (build_tokenizer, "the tiny world's character tokenizer (tiny:tokenizer)"),
    "bpe": (bpe_teacher.build_bpe_tokenizer, "byte-level BPE, digits one a token (build.bpe_teacher)"),
}


def transcript_row(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> dict:
    """A transcript's input ids with the calculator listed, and its labels: the assistant's turns only."""
    enc = tokenizer.apply_chat_template(
        messages, tools=task.TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    return {"input_ids": ids, "labels": [t if m else IGNORE for t, m in zip(ids, mask)]}


class TranscriptRows(torch.utils.data.Dataset):
    """SFT rows of teacher transcripts on training problems drawn from `seed` (tokenized when asked for)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, n: int, seed: int):
        self.tokenizer, self.probs = tokenizer, task.training_problems(n, seed)

    def __len__(self) -> int:
        return len(self.probs)

    def __getitem__(self, i: int) -> dict:
        return transcript_row(self.tokenizer, task.teacher_messages(self.probs[i]))


def greedy_turn(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    """One greedy assistant turn for each conversation, rendered with the calculator listed."""
    ids = [
        list(
            tokenizer.apply_chat_template(
                c, tools=task.TOOLS, add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for c in conversations
    ]
    device = next(model.parameters()).device
    ids_BP, mask_BP = sampling.left_pad(ids, tokenizer.pad_token_id, device)
    greedy = engines.SamplingSettings(
        max_new_tokens, 0.0, 1.0, models.eos_ids(tokenizer, model), tokenizer.pad_token_id
    )
    return sampling.decode_completions(
        tokenizer, engines.HFEngine().sample(model, ids_BP, mask_BP, greedy, 0)
    )


def tool_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: list[list[dict]],
    answers: list[str],
    batch_size: int = 256,
) -> dict:
    """Greedy episodes with the calculator (`tasks.evaluate.episode_accuracy`, the training rollouts' loop at
    temperature 0, against `CalculatorEnvironment`: calls parsed by `parse_calls`, answered by `calculate`,
    never `eval`), up to two turns of `MAX_TURN_TOKENS`. Returns the shares `correct` (graded by the task),
    `called_tool` (episodes with a call) and `tool_call_share` (episodes whose calls were all well formed and
    one of whose results is the sum)."""
    was_training = model.training
    model.eval()
    acc = episode_accuracy(
        model,
        tokenizer,
        CalculatorEnvironment(task.TinyToolsTask()),
        messages,
        answers,
        max_turns=2,
        max_new_tokens=task.MAX_TURN_TOKENS,
        batch_size=batch_size,
    )
    model.train(was_training)
    return {"correct": acc.raw, "called_tool": acc.called_share, "tool_call_share": acc.tool_call_share}


def train_tool_teacher(
    model,
    tokenizer: PreTrainedTokenizerBase,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    eval_every: int,
    eval_n: int,
    stop_accuracy: float,
    on_record=None,
) -> list[dict]:
    """Completion-only SFT on fresh transcripts (`tiny_world.sft_until`, as `tiny_world.train_on_task`);
    every `eval_every` steps the accuracy with the tool on `eval_n` problems of the build's own stream is
    recorded, and training stops once it reaches `stop_accuracy`. Returns that history."""
    messages, answers = task.TinyToolsTask().heldout(eval_n, seed=EVAL_SEED)
    return build.sft_until(
        model,
        tokenizer,
        TranscriptRows(tokenizer, steps * batch_size, seed),
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        eval_every=eval_every,
        evaluate=lambda: tool_accuracy(model, tokenizer, messages, answers)["correct"],
        stop_when=lambda acc: acc >= stop_accuracy,
        desc="teacher-tools",
        on_record=on_record,
    )


def heldout_figures(model, tokenizer, n: int = 500) -> dict:
    """Accuracy with the tool, and the share of episodes that call it, on `n` held-out problems."""
    messages, answers = task.TinyToolsTask().heldout(n)
    acc = tool_accuracy(model, tokenizer, messages, answers)
    return {
        "n": n,
        "accuracy": acc["correct"],
        "called_tool": acc["called_tool"],
        "tool_call_share": acc["tool_call_share"],
    }


def build_tool_teacher(
    out: str | Path,
    *,
    steps: int = 600,
    stop_accuracy: float = 0.99,
    eval_every: int = 50,
    eval_n: int = 200,
    seed: int = 0,
    tokenizer: str = "char",
) -> dict:
    """Train and save the teacher into `out` (`tokenizer`: char, the student's, or bpe); returns what
    `recipe.json` records."""
    out, t0 = Path(out), time.time()
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer, tokenizer_text = TOKENIZERS[tokenizer]
    tokenizer = make_tokenizer()
    teacher = build.qwen3_model(TEACHER, tokenizer, seed)

    def record(history: list[dict], **more) -> dict:
        rec = {
            "task": "sums of four 3-digit numbers with a calculator (opdkit.tasks.tinytools)",
            "tokenizer": f"{tokenizer_text}, {len(tokenizer)} tokens",
            "seed": seed,
            "stop_accuracy": stop_accuracy,
            "teacher": {**asdict(TEACHER), "params": teacher.num_parameters(), "history": history},
            **more,
        }
        (out / "recipe.json").write_text(json.dumps(rec, indent=2))
        return rec

    history = train_tool_teacher(
        teacher,
        tokenizer,
        steps=steps,
        lr=3e-3,
        batch_size=64,
        seed=seed + 11,
        eval_every=eval_every,
        eval_n=eval_n,
        stop_accuracy=stop_accuracy,
        on_record=record,
    )
    train_seconds = round(time.time() - t0, 1)
    teacher.save_pretrained(out)
    tokenizer.save_pretrained(out)
    student = models.load_model("tiny:student")
    return record(
        history,
        teacher_heldout_with_tool=heldout_figures(teacher, tokenizer),
        student_heldout_without_tool=heldout_figures(student, build_tokenizer(), n=200),
        train_seconds=train_seconds,
        build_seconds=round(time.time() - t0, 1),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write the teacher and its tokenizer into")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument(
        "--stop-accuracy", type=float, default=0.99, help="stop once the build's accuracy reaches it"
    )
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="char", choices=tuple(TOKENIZERS), help="the student's, or BPE")
    a = p.parse_args()
    rec = build_tool_teacher(
        a.out,
        steps=a.steps,
        stop_accuracy=a.stop_accuracy,
        eval_every=a.eval_every,
        seed=a.seed,
        tokenizer=a.tokenizer,
    )
    print(json.dumps({k: v for k, v in rec.items() if k != "teacher"}, indent=2))


if __name__ == "__main__":
    main()
