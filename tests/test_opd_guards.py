"""opdkit.opd.guards: the sampler checks of the first steps (against the current weights for rollouts
sampled in the step, against their own for rollouts sampled ahead) stop the run in one line past the
engine's tolerance; a non-finite gradient never reaches the weights (the step skipped, the run stopped).
The whole-run cases are in tests/test_rollout_ahead.py and tests/test_jobs_whitebox.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from opdkit.opd.guards import SYNC_CHECK_STEPS, NonFiniteStop, SamplerChecks, guarded_step
from opdkit.rollout.engines import WeightSyncError


def _records(version):
    return [SimpleNamespace(sampling_logprobs_BT=torch.zeros(1), policy_version=version)]


def test_the_first_steps_check_what_sampled_them_and_stop_in_one_line():
    checks = SamplerChecks(world_size=1)
    for _ in range(SYNC_CHECK_STEPS):
        checks.start_step(_records(None))
        assert checks.check_sync_now and not checks.sampler_gap_now
        checks.after_loss(torch.zeros(3), SimpleNamespace(logprob_dtype=lambda: "float32"), 0)
    checks.start_step(_records(None))
    assert not checks.check_sync_now  # past the first steps: no host read
    checks.start_step(_records(3))
    assert checks.sampler_gap_now and checks.check_sampler_now and not checks.check_sync_now
    with pytest.raises(WeightSyncError) as err:
        checks.check(torch.full((4,), 0.5), True, "float32", step=4)
    assert str(err.value).startswith("step 5: the rollout producer's log-probabilities")
    assert "\n" not in str(err.value)
    checks.check(torch.full((4,), 0.05), False, "bfloat16", step=0)  # within a bf16 engine's tolerance


class _Trainer:  # held weakly by the guards
    last_grad_norm: float | None = None
    first_nonfinite_step: int | None = None


def test_a_non_finite_gradient_never_reaches_the_weights_and_stops_the_run():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    trainer = _Trainer()
    opt.step = guarded_step(trainer, opt)
    w.grad = torch.ones(2)
    opt.step()  # before any measured step the optimizer steps
    trainer.last_grad_norm = math.nan
    opt.step()
    assert torch.equal(w.detach(), torch.zeros(2))
    control = SimpleNamespace(should_training_stop=False, should_save=True)
    assert not NonFiniteStop(trainer).on_step_end(None, None, control).should_training_stop
    trainer.first_nonfinite_step = 3
    control = NonFiniteStop(trainer).on_step_end(None, None, control)
    assert control.should_training_stop and not control.should_save
