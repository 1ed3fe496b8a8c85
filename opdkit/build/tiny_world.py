"""The recipe that rebuilt the tiny world shipped in `opdkit/tiny/assets/`.

    python -m opdkit.build.tiny_world --out opdkit/tiny/assets        # ~10 minutes on 2 CPU cores

Writes `tokenizer/`, `teacher/` and `student/` as ordinary Hugging Face folders (Qwen3 architecture,
safetensors) plus `recipe.json` with the measured accuracies. The teacher is trained by SFT on
scratchpads whose column order is random, until it solves held-out problems almost perfectly. The
student is 10x smaller and deliberately under-trained: it stops as soon as it writes the format and
gets a few answers right, which leaves a training gap that on-policy distillation closes.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen3Config, Qwen3ForCausalLM

from opdkit.data import sft
from opdkit.tasks import evaluate
from opdkit.tasks import tiny as task
from opdkit.tiny.tokenizer import build_tokenizer

TINY = task.TinyTask()


@dataclass
class ModelSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int


TEACHER = ModelSpec(128, 4, 4, 2, 384, 32)
STUDENT = ModelSpec(64, 2, 2, 1, 192, 32)


def qwen3_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
        **asdict(spec),
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


def conversation(problem: task.Problem, rng: random.Random) -> list[dict]:
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": task.scratchpad(problem, rng)},
    ]


def train_on_task(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    eval_every: int,
    stop_when,
    eval_n: int = 500,
    desc: str = "sft",
) -> list[dict]:
    rng = random.Random(seed)

    def next_batch(step: int):
        convs = [conversation(task.sample_problem(rng), rng) for _ in range(batch_size)]
        return [sft.sft_batch(tokenizer, convs)]

    def evaluate_now(step: int) -> float:
        return heldout_accuracy(model, tokenizer, n=eval_n, seed=777)  # not the held-out seed

    _, history = sft.train_sft(
        model,
        next_batch,
        steps,
        lr,
        warmup_steps=50,
        betas=(0.9, 0.98),
        evaluate=evaluate_now,
        eval_every=eval_every,
        stop_when=stop_when,
        desc=desc,
    )
    return history


def heldout_accuracy(
    model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerBase, n: int = 500, seed: int | None = None
) -> float:
    """Greedy exact match on `n` held-out problems (`seed`: another stream than the evaluation pool)."""
    messages, answers = TINY.heldout(n, seed)
    acc = evaluate.accuracy(
        model, tokenizer, TINY, messages, answers, max_new_tokens=TINY.max_new_tokens, batch_size=256
    )
    return acc.raw


def build_tiny_world(
    out: str | Path,
    *,
    teacher_steps: int = 6000,
    student_steps: int = 2000,
    student_stop_accuracy: float = 0.15,
    teacher_stop_accuracy: float = 0.995,
    eval_every: int = 250,
    seed: int = 0,
) -> dict:
    """Build tokenizer, teacher and student into `out`; returns what `recipe.json` records."""
    out = Path(out)
    t0 = time.time()
    tokenizer = build_tokenizer()
    teacher = qwen3_model(TEACHER, tokenizer, seed)
    t_hist = train_on_task(
        teacher,
        tokenizer,
        steps=teacher_steps,
        lr=3e-3,
        batch_size=64,
        seed=seed + 1,
        eval_every=eval_every,
        stop_when=lambda acc: acc >= teacher_stop_accuracy,
        desc="teacher",
    )
    student = qwen3_model(STUDENT, tokenizer, seed + 2)
    s_hist = train_on_task(
        student,
        tokenizer,
        steps=student_steps,
        lr=3e-3,
        batch_size=64,
        seed=seed + 3,
        eval_every=max(1, eval_every // 5),
        stop_when=lambda acc: acc >= student_stop_accuracy,
        desc="student",
    )
    for name, obj in (("tokenizer", tokenizer), ("teacher", teacher), ("student", student)):
        obj.save_pretrained(out / name)
    tokenizer.save_pretrained(out / "teacher")
    tokenizer.save_pretrained(out / "student")
    record = {
        "task": "3-digit addition with a column scratchpad (opdkit.tasks.tiny)",
        "seed": seed,
        "teacher": {**asdict(TEACHER), "params": teacher.num_parameters(), "history": t_hist},
        "student": {**asdict(STUDENT), "params": student.num_parameters(), "history": s_hist},
        "teacher_heldout_accuracy": heldout_accuracy(teacher, tokenizer),
        "student_heldout_accuracy": heldout_accuracy(student, tokenizer),
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "recipe.json").write_text(json.dumps(record, indent=2))
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder to write tokenizer/, teacher/, student/ into")
    p.add_argument("--teacher-steps", type=int, default=6000)
    p.add_argument("--student-steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rec = build_tiny_world(a.out, teacher_steps=a.teacher_steps, student_steps=a.student_steps, seed=a.seed)
    print(json.dumps({k: v for k, v in rec.items() if k not in ("teacher", "student")}, indent=2))


if __name__ == "__main__":
    main()
