"""opdkit.opd.metrics: a step's columns from its sums (per sequence, per loss token, the engine gap where
log-probabilities were reported), and with rollouts sampled ahead their importance ratios (mean, maximum,
share past the cap) and the sampler gap; none of them where nothing was measured."""

from __future__ import annotations

import math

import torch

from opdkit.opd.metrics import Processes, StepStats, async_columns, step_columns


def test_the_steps_columns_from_its_sums():
    stats = StepStats(sequences=2.0, completion_tokens=torch.tensor(8.0), truncated=torch.tensor(1.0))
    stats.entropy_sum = torch.tensor(4.0)
    stats.add_gap(torch.tensor([0.1, 0.3]))
    stats.add_teacher_sums(torch.tensor([1.0, 2.0]))
    stats.add_teacher_sums(torch.tensor([1.0, 1.0]))
    logs = {"loss": 0.5, "grad_norm": 3.0, "learning_rate": 1e-3}
    row, teacher_sums = step_columns(stats, logs, 7, 1.0, True, Processes("cpu", 1))
    assert teacher_sums == [2.0, 3.0]
    assert row["step"] == 7 and row["clipped"] and row["completion_length"] == 4.0
    assert row["truncated_fraction"] == 0.5 and row["entropy"] == 0.5
    assert math.isclose(row["engine_logprob_gap"], 0.2, rel_tol=1e-6)
    quiet, _ = step_columns(StepStats(), logs, 1, math.inf, False, Processes("cpu", 1))
    assert quiet["engine_logprob_gap"] is None and quiet["entropy"] is None and not quiet["clipped"]


def test_the_importance_ratios_and_the_sampler_gap_of_a_step_sampled_ahead():
    stats = StepStats(staleness=1)
    stats.add_ratios(torch.log(torch.tensor([0.5, 1.0, 3.0])), cap=2.0)
    stats.add_ratios(torch.log(torch.tensor([1.5])), cap=2.0)
    stats.sampler_gap = torch.tensor([0.2, 4.0], dtype=torch.float64)
    cols = async_columns(stats, Processes("cpu", 1))
    assert cols["async/staleness"] == 1 and math.isclose(cols["async/ratio_mean"], 1.5, rel_tol=1e-6)
    assert math.isclose(cols["async/ratio_max"], 3.0, rel_tol=1e-6) and cols["async/capped_share"] == 0.25
    assert math.isclose(cols["async/sampler_logprob_gap"], 0.05, rel_tol=1e-6)
    none = async_columns(StepStats(), Processes("cpu", 1))
    assert none["async/ratio_mean"] is None and none["async/sampler_logprob_gap"] is None
