"""TrainerCallbacks of white-box distillation: the gradient the optimizer applies (a debugging aid and the
tests' window into a step), greedy accuracy every N steps (`add_step_accuracy`), and the logged completions as
a table in the tracker (`report_samples`; kept here, not in `run.tracking`, which a dry run imports).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import TrainerCallback

from opdkit.run import sharding
from opdkit.run.folders import print0
from opdkit.run.tracking import Tracker


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


class SampleTables(TrainerCallback):
    """02's logged completions (samples.jsonl) as a table in the tracker that the Trainer reports to."""

    def __init__(self, report_to: str, run):
        self.report_to, self.run, self.seen, self.tracker = report_to, run, 0, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not (self.run.path / "samples.jsonl").is_file():
            return
        samples = self.run.read_jsonl("samples.jsonl")
        new, self.seen = samples[self.seen :], len(samples)
        if new:
            self.tracker = self.tracker or Tracker.active(self.report_to, self.run)
            self.tracker.table("samples", [sample_row(s) for s in new], step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.tracker is not None and self.tracker.backend == "tensorboard":
            self.tracker.finish()  # the others belong to the Trainer's integration, which finishes them


def sample_row(sample: dict) -> dict:
    divergence = sample.get("divergence") or [0.0]
    return {
        "step": sample["step"],
        "prompt": sample["prompt"],
        "completion": "".join(sample["tokens"]),
        "mean_divergence": sum(divergence) / len(divergence),
        "answer": sample.get("answer"),
    }


def report_samples(trainer, report_to: str, run) -> None:
    """Send a Trainer's tensorboard scalars to `<run_dir>/tensorboard` and its sample tables to the
    tracker."""
    if report_to == "none":
        return
    for callback in trainer.callback_handler.callbacks:
        if type(callback).__name__ == "TensorBoardCallback":
            callback.logging_dir = str(run.path / "tensorboard")
    trainer.add_callback(SampleTables(report_to, run))
