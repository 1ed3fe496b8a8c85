"""TrainerCallbacks of white-box distillation: the gradient the optimizer applies (a debugging aid and the
tests' window into a step), and greedy accuracy every N steps (`add_step_accuracy`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback

from opdkit.run import sharding
from opdkit.run.folders import print0


class GradientDump(TrainerCallback):
    """Debugging aid: save the gradient the optimizer is about to apply at `at_step` (accumulated,
    averaged over processes, gathered to full tensors under FSDP; clipped if clipping is on) on rank 0."""

    def __init__(self, path: str, at_step: int = 1):
        self.path, self.at_step = path, at_step

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 != self.at_step:
            return
        # Every rank takes part: gathering a sharded gradient is a collective.
        grads = {
            n: sharding.full_tensor(p.grad).detach().cpu().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        if args.process_index == 0:
            torch.save(grads, self.path)


class StepAccuracy(TrainerCallback):
    """Every `every` optimizer steps, `measure(model)` (greedy accuracy on a held-out slice, all processes
    taking part) is logged as `eval_accuracy` through `log` (the trainer's: metrics.jsonl and trackers); a
    measure that returns a dict is logged as it is (`eval_accuracy` and more, e.g. `eval_tool_call_share`)."""

    def __init__(self, measure: Callable, every: int, log: Callable[[dict], None]):
        self.measure, self.every, self.log = measure, every, log

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.every or state.global_step % self.every:
            return
        was_training = model.training
        model.eval()
        try:
            value = self.measure(model)
        finally:
            model.train(was_training)
        if value is not None:
            should_log = control.should_log  # logging resets it, and the step's own record is still due
            self.log(value if isinstance(value, dict) else {"eval_accuracy": value})
            control.should_log = should_log
        return control


def add_step_accuracy(trainer, measure: Callable, every: int) -> None:
    """Accuracy while training (`StepAccuracy`, `measure(model)` on the unwrapped student). Not under FSDP:
    every rank generates for its own share of prompts, and sharded layers, whose every forward is a
    collective, would wait on ranks that have stopped."""
    if trainer.is_fsdp_enabled:
        print0("eval_every is skipped under parallelism fsdp; the accuracy after training is still measured")
        return
    trainer.add_callback(
        StepAccuracy(lambda model: measure(trainer.accelerator.unwrap_model(model)), every, trainer.log)
    )
