"""The recipe that rebuilt the tiny world shipped in `opdkit/tiny/assets/`.

    python -m opdkit.build.tiny_world --out opdkit/tiny/assets        # ~10 minutes on 2 CPU cores

Writes `tokenizer/`, `teacher/` and `student/` as ordinary Hugging Face folders (Qwen3 architecture,
safetensors) plus `recipe.json` with the measured accuracies. The teacher is trained by SFT (the kit's one SFT
loop, `opdkit.sft.trainer`) on scratchpads whose column order is random, until it solves held-out problems
almost perfectly. The
student is 10x smaller and deliberately under-trained: it stops as soon as it writes the format and
gets a few answers right, which leaves a training gap that on-policy distillation closes.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    TrainerCallback,
    TrainingArguments,
)

from opdkit.data import labels
from opdkit.sft.trainer import CompletionSFTTrainer
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


class TaskRows(torch.utils.data.Dataset):
    """An endless-looking stream of SFT rows on the task: row `i` is a problem with a scratchpad whose column
    order is random, both drawn from (`seed`, `i`), tokenized when asked for (nothing is held in memory)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, n: int, seed: int):
        self.tokenizer, self.n, self.seed = tokenizer, n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = random.Random(f"{self.seed}-{i}")
        ids, labs = labels.completion_labels(self.tokenizer, conversation(task.sample_problem(rng), rng))
        return {"input_ids": ids, "labels": labs}


class EvaluateAndStop(TrainerCallback):
    """Every `every` steps: `evaluate()` recorded in `history` with the step's loss (and the history so far
    handed to `on_record`, if given); training stops once `stop_when(value)`."""

    def __init__(self, trainer: CompletionSFTTrainer, evaluate, every: int, stop_when, on_record=None):
        self.trainer, self.evaluate, self.every, self.stop_when = trainer, evaluate, every, stop_when
        self.on_record = on_record
        self.history: list[dict] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.every or state.global_step % self.every:
            return control
        model.eval()
        value = self.evaluate()
        model.train()
        self.history.append({"step": state.global_step, "loss": self.trainer.step_losses[-1], "eval": value})
        if self.on_record is not None:
            self.on_record(self.history)
        if self.stop_when(value):
            control.should_training_stop = True
        return control


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
    on_record=None,
) -> list[dict]:
    """`sft_until` on fresh problems of the task (`TaskRows`); every `eval_every` steps the held-out accuracy
    (another stream than the evaluation pool) is recorded (and the history so far handed to `on_record`, if
    given), and training stops once `stop_when` says so. Returns that history."""
    return sft_until(
        model,
        tokenizer,
        TaskRows(tokenizer, steps * batch_size, seed),
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seed=seed,
        eval_every=eval_every,
        evaluate=lambda: heldout_accuracy(model, tokenizer, n=eval_n, seed=777),
        stop_when=stop_when,
        desc=desc,
        on_record=on_record,
    )


def sft_until(
    model,
    tokenizer: PreTrainedTokenizerBase,
    rows: torch.utils.data.Dataset,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    eval_every: int,
    evaluate,
    stop_when,
    desc: str = "sft",
    on_record=None,
) -> list[dict]:
    """Completion-only SFT (`sft.trainer.CompletionSFTTrainer`) on `rows`, the next `batch_size` a step
    (`steps * batch_size` rows in all): AdamW (betas 0.9, 0.98), 50 warmup steps then cosine, clipping at 1;
    every `eval_every` steps `evaluate()` is recorded (`EvaluateAndStop`, the history so far handed to
    `on_record`, if given), and training stops once `stop_when(value)`. Returns that history."""
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            learning_rate=lr,
            adam_beta2=0.98,
            lr_scheduler_type="cosine",
            warmup_steps=50,
            max_grad_norm=1.0,
            weight_decay=0.0,
            seed=seed,
            save_strategy="no",
            report_to=[],
            logging_steps=max(1, eval_every),
            disable_tqdm=False,
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            remove_unused_columns=False,
            run_name=desc,
        )
        order = [list(range(s * batch_size, (s + 1) * batch_size)) for s in range(steps)]
        trainer = CompletionSFTTrainer(
            model=model, args=args, train_dataset=rows, order=order, pad_token_id=tokenizer.pad_token_id
        )
        stopper = EvaluateAndStop(trainer, evaluate, eval_every, stop_when, on_record)
        trainer.add_callback(stopper)
        trainer.train()
    model.eval()
    return stopper.history


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
