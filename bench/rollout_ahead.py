"""What sampling ahead buys (issue 39): tiny 02's distillation steps per second with `rollout_ahead: 1` (a
producer process samples the next step's rollouts while this one trains) against the synchronous run, in
alternating runs, the median of each and their ratio.

    OMP_NUM_THREADS=1 python -m bench.rollout_ahead --steps 30 --reps 5

Each run is a `DistillTrainer` at 02 tiny's step (64 prompts, 40 new tokens, learning rate 1e-3, clipping
at 1, the tiny teacher in process), no evaluation or checkpoints. `steady` counts steps 6 to the last (the
producer's start-up left out: the whitebox job hides it behind its accuracy before training); `with start-up`
counts from `train()` on. With one thread each, the trainer and the producer each take one core of a
2-core machine; anything else running takes cores from one of them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from opdkit import tiny
from opdkit.data.prompts import PromptCollator
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.tasks import tiny as task

WARM = 5  # steps left out of the steady rate


class _Clock(TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.time())


def run(ahead: int, steps: int) -> dict:
    """One run of `steps` optimizer steps: its steady and whole steps per second, its last loss."""
    tok = load_tokenizer("tiny:student")
    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer}
        for p in task.problems(64 * steps, 42)
    ]
    clock = _Clock()
    args = OPDArguments(
        output_dir=tempfile.mkdtemp(),
        report_to=[],
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        max_steps=steps,
        per_device_train_batch_size=64,
        rollout_max_new_tokens=40,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=42,
        rollout_ahead=ahead,
    )

    def load(name: str):
        return AutoModelForCausalLM.from_pretrained(tiny.resolve(name))

    trainer = DistillTrainer(
        model=load("tiny:student"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        data_collator=PromptCollator(tok, 64),
        processing_class=tok,
        teacher_model=load("tiny:teacher").eval(),
        callbacks=[clock],
    )
    start = time.time()
    try:
        trainer.train()
    finally:
        trainer.close_engine()
    e = clock.ends
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "steady": (len(e) - WARM) / (e[-1] - e[WARM - 1]),
        "whole": len(e) / (e[-1] - start),
        "last_loss": losses[-1],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    if a.steps <= WARM:
        p.error(f"--steps must be above {WARM}")
    got: dict[int, list[dict]] = {0: [], 1: []}
    for i in range(a.reps):
        for s in (0, 1) if i % 2 == 0 else (1, 0):
            r = run(s, a.steps)
            got[s].append(r)
            print(
                f"rollout_ahead {s}: steady {r['steady']:.3f} steps/s, "
                f"with start-up {r['whole']:.3f} steps/s, last loss {r['last_loss']:.4f}",
                flush=True,
            )
    for key, what in (("steady", "steady"), ("whole", "with start-up")):
        med = {s: statistics.median(x[key] for x in v) for s, v in got.items()}
        ratio = med[1] / med[0]
        print(f"median {what} steps/s: synchronous {med[0]:.3f}, ahead 1 {med[1]:.3f}, ratio {ratio:.2f}")


if __name__ == "__main__":
    main()
