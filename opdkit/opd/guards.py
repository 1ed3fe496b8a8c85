"""What stops or flags a `DistillTrainer` run going wrong, each before it can do harm: the sampler's
log-probabilities checked against the student's in the first steps (a wrong weight sync), a non-finite
gradient kept from the weights (the step skipped, the run stopped with the last good weights), and what each
process holds of both models recorded when training begins (a sharding that silently failed).

    checks = SamplerChecks(world_size=1)
    checks.start_step(records)                          # which of the step's micro-batches check what
    checks.sampler_gap(student, source, record, ...)    # rollouts sampled ahead: against their own weights
    checks.after_loss(gap_N, source, step)              # WeightSyncError past the engine's tolerance
    trainer.add_callback(NonFiniteStop(trainer)); opt.step = guarded_step(trainer, opt)

A vLLM engine synced with the student reports log-probabilities of the current weights: in a fresh run the
engine loaded the first step's weights from the student's own folder, so a wrong sync first shows at the
second step (after a resume, at the first). Rollouts sampled ahead come from older weights: their gap is
measured instead against the weights that sampled them (`sampler_gap`, one extra forward on each step's
first micro-batch, logged as `async/sampler_logprob_gap`), which is zero but for rounding when the producer
loaded what it was sent, whatever the staleness.
"""

from __future__ import annotations

import json
import math
import weakref

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from opdkit import memory
from opdkit.rollout import engines
from opdkit.rollout.source import RolloutRecord, RolloutSource
from opdkit.rollout.weights import logprobs_under
from opdkit.run.files import atomic_write_text

SYNC_CHECK_STEPS = 2  # the first steps whose sampler log-probabilities are checked (one host read each)


class SamplerChecks:
    """The engine's log-probabilities of the sampled tokens against the student's, in the first
    `SYNC_CHECK_STEPS` steps that have them: against the current weights for rollouts sampled in the step,
    against the weights that sampled them for rollouts sampled ahead. Each step's first micro-batch only."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._sync_left = self._sampler_left = SYNC_CHECK_STEPS
        self.check_sync_now = False  # the step's first micro-batch checks the gap to the current weights
        self.sampler_gap_now = False  # the step's first micro-batch measures the gap to its own weights
        self.check_sampler_now = False  # and checks it (the first steps sampled ahead)

    def start_step(self, records: list[RolloutRecord]) -> None:
        """What the step's micro-batches check: a sync check compares an engine with the current weights,
        which rollouts sampled ahead were not."""
        reported = [r for r in records if r.sampling_logprobs_BT is not None]
        self.check_sync_now = self._sync_left > 0 and any(r.policy_version is None for r in reported)
        self._sync_left -= self.check_sync_now
        self.sampler_gap_now = any(r.policy_version is not None for r in reported)
        self.check_sampler_now = self._sampler_left > 0 and self.sampler_gap_now
        self._sampler_left -= self.check_sampler_now

    def sampler_gap(
        self,
        student: torch.nn.Module,
        source: RolloutSource,
        record: RolloutRecord,
        fwd: dict,
        pred_BT: torch.Tensor,
        target_N: torch.Tensor,
        sampling_logprobs_N: torch.Tensor,
        settings,
        step: int,
    ) -> torch.Tensor | None:
        """Rollouts sampled ahead, the step's first micro-batch only (one extra forward per step, no
        gradient): (sum of |log p_engine(y_t) - log p_version(y_t)| over its sampled tokens, their count),
        p_version the student under the weights that sampled them (`source.weights_of`, through
        `weights.logprobs_under`: no copy of the model, a transient one of the weights on its device),
        float32, temperature 1, the head `settings.loss_chunk_size` positions at a time. Checked in the first
        steps sampled ahead; None where the weights are no longer kept."""
        self.sampler_gap_now = False
        weights = source.weights_of(record.policy_version)
        if weights is None:
            return None
        version_logp_N = logprobs_under(student, weights, fwd, pred_BT, target_N, settings.loss_chunk_size)
        gap_N = (version_logp_N - sampling_logprobs_N.to(version_logp_N)).abs()
        if self.check_sampler_now:
            self.check_sampler_now = False
            self.check(gap_N, True, source.logprob_dtype(), step)
        return torch.stack([gap_N.sum(), gap_N.new_tensor(float(gap_N.shape[0]))]).double()

    def after_loss(self, gap_N: torch.Tensor, source: RolloutSource, step: int) -> None:
        """The sync check of rollouts sampled in the step, on the step's first micro-batch (`gap_N`: its
        |log p_sampler - log p_student| per sampled token)."""
        if self.check_sync_now:
            self.check_sync_now = False
            self.check(gap_N, False, source.logprob_dtype(), step)

    def check(self, gap_N: torch.Tensor, stale: bool, dtype: str, step: int) -> None:
        """The one host read before a backward pass (first steps only): every rank stops together
        (`engines.WeightSyncError`) if the micro-batch's gap, summed over all processes, is off for an engine
        of `dtype`. `stale`: the gap of a producer sampling ahead against the weights it was sent."""
        sums = torch.stack([gap_N.sum(), torch.tensor(float(gap_N.shape[0]), device=gap_N.device)]).double()
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        who = "rollout producer's" if stale else "vLLM engine's"
        engines.check_sync(*sums.tolist(), dtype=dtype, step=step + 1, who=who)


def guarded_step(trainer, opt: torch.optim.Optimizer):
    """`opt.step` that never lets a non-finite gradient reach the weights: the update skipped (the run then
    stops, `NonFiniteStop`). Before any measured step the optimizer must step: loading a sharded optimizer
    state (FSDP resume) first creates the state with one zero-lr step. Trainer and optimizer held weakly
    (the optimizer's own step unbound): `opt.step` referring back to them would be a reference cycle keeping
    the model and the AdamW state alive after training."""
    step = opt.step
    me, opt_ref = weakref.ref(trainer), weakref.ref(opt)
    unbound = step.__func__ if getattr(step, "__self__", None) is opt else None
    if unbound is not None:
        del step

    def guarded(*args, **kwargs):
        norm = getattr(me(), "last_grad_norm", None)
        if norm is None or math.isfinite(norm):
            return unbound(opt_ref(), *args, **kwargs) if unbound is not None else step(*args, **kwargs)
        return None

    return guarded


class NonFiniteStop(TrainerCallback):
    """Stops training after a non-finite step (the trainer's `first_nonfinite_step`). Its trainer is held
    weakly: the trainer holds this callback, and a strong reference back would be a cycle keeping a finished
    trainer's models (and on a GPU their memory) alive until a garbage collection happens to run."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer.first_nonfinite_step is not None:
            control.should_training_stop = True
            control.should_save = False  # keep the last good checkpoint as the newest one
        return control


class HeldRecord(TrainerCallback):
    """When training begins (the student prepared, sharded under FSDP; the teacher placed or sharded), each
    process records what it holds of both models, counted on the tensors (`memory.held_by`): printed, and
    written to the run folder's held/rank<k>.json, so that a sharding that silently failed shows."""

    def __init__(self, trainer):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is None:
            return
        models = {"student": trainer.model, "teacher": trainer.teacher.module}
        held = {role: memory.held_by(m) for role, m in models.items() if isinstance(m, torch.nn.Module)}
        row = {"rank": args.process_index, "world_size": args.world_size, "models": held}
        print(memory.held_line(row), flush=True)
        if trainer.run is not None:
            folder = trainer.run.path / memory.HELD_DIR
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / f"rank{args.process_index}.json", json.dumps(row, indent=2))
