"""Multi-turn episodes sampled ahead (`environment` with `rollout_ahead` >= 1, issue 48): the producer plays
the episodes of the tiny tool world (tool calls, the calculator's results) against its own copy of the
environment. With unchanged weights (learning rate 0) the run sampling one step ahead, corrected, takes the
synchronous run's episodes, losses and `tool/` columns (which come back from the producer) with importance
ratios of 1; killed after step 2 and resumed from checkpoint-2, a run sampling ahead regenerates its queued
step with the weights that sampled it and ends with the unbroken run's per-step losses."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
from helpers import TOOL_RUN, episodes, run_tiny, tool_turns
from transformers import TrainerCallback

from opdkit.rollout import ahead
from opdkit.run.lifecycle import RunFailed

# 16 prompts of the tiny tool world, 4 episodes a step: one epoch of 4 steps.
EPISODES = {**TOOL_RUN, "per_device_train_batch_size": 4, "max_steps": 4, "rollout_temperature": 1.0}
TOOL_COLUMNS = ("tool/episodes", "tool/called_share", "tool/calls_per_episode", "tool/turns_mean")


def steps(run) -> list[dict]:
    return [r for r in run.read_jsonl() if "loss" in r]


class KillProducer(TrainerCallback):
    """Kills the run's rollout producer (SIGKILL) at the end of step `at`, before that step's checkpoint."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            (producer,) = [p for p in multiprocessing.active_children() if p.name == "opdkit-rollouts"]
            os.kill(producer.pid, signal.SIGKILL)


def test_episodes_sampled_ahead_by_unchanged_weights_are_the_synchronous_episodes(tmp_path):
    """Learning rate 0, `rollout_ahead 1`, `async_correction truncated`: every step's episodes (token ids and
    loss masks, tool turns in every one of the first step's), loss and `tool/` columns are the synchronous
    run's, the ratios 1 to rounding; the steps after the first were sampled a step ahead."""
    over = {**EPISODES, "learning_rate": 0.0}
    sync = run_tiny(tmp_path, "sync", **over)
    ahead_run = run_tiny(tmp_path, "ahead", **over, rollout_ahead=1, async_correction="truncated")
    rows = episodes(ahead_run.path)
    assert sorted(rows) == sorted(episodes(sync.path)) and len(rows) == 4
    assert all(tool_turns(mask) >= 1 for _, mask in rows), "every episode calls the calculator"
    got, want = steps(ahead_run), steps(sync)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    assert [r["async/staleness"] for r in got] == [0, 1, 1, 1]
    for a, s in zip(got, want):
        assert a["loss"] == pytest.approx(s["loss"], rel=1e-5), a["step"]
        assert abs(a["async/ratio_mean"] - 1) < 1e-5 and a["async/capped_share"] == 0
        for key in TOOL_COLUMNS:
            assert a[key] == s[key], (a["step"], key)
    assert got[0]["tool/episodes"] == 4 and got[0]["tool/called_share"] == 1.0


def test_episodes_sampled_ahead_killed_and_resumed_end_with_the_unbroken_runs_losses(tmp_path):
    """`rollout_ahead 1` at the preset's learning rate, checkpointed every 2 steps: the producer killed after
    step 2 stops the run; checkpoint-2 keeps the queued step (0-based 2) and version 1's weights that sample
    it; resumed, the run logs the unbroken run's staleness, per-step losses and `tool/` columns."""
    over = {**EPISODES, "rollout_ahead": 1, "checkpoint_every": 2, "save_rollouts": False}
    unbroken = run_tiny(tmp_path, "unbroken", **over)
    with pytest.raises(RunFailed, match="rollout producer"):
        run_tiny(tmp_path, "broken", [KillProducer(2)], **over)
    plans, weights = ahead.load_queued(tmp_path / "broken" / "checkpoints" / "checkpoint-2")
    assert plans == {2: 1} and sorted(weights) == [1]
    resumed = run_tiny(tmp_path, "broken", resume=True, **over)
    got, want = steps(resumed), steps(unbroken)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4]
    for a, u in zip(got, want):
        assert a["async/staleness"] == u["async/staleness"], a["step"]
        assert a["loss"] == pytest.approx(u["loss"], rel=1e-5), a["step"]
        for key in TOOL_COLUMNS:
            assert a[key] == u[key], (a["step"], key)
    assert len({r["loss"] for r in want}) == 4  # the weights moved: a wrong version would show
