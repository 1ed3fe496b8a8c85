"""02's accuracy before and after distillation decode at one precision, and the summary says which: with
bf16 the student used to decode in fp32 before training and under accelerate's bf16 autocast after."""

from __future__ import annotations

import pytest
import torch

from opdkit.jobs import whitebox
from opdkit.rollout import greedy as evaluate

STILL = dict(
    max_steps=1,
    learning_rate=0.0,
    weight_decay=0.0,
    subset_size=8,
    eval_size=24,
    per_device_train_batch_size=4,
    rollout_max_new_tokens=12,
    checkpoint_every=0,
    sample_every=0,
)


@pytest.mark.parametrize("bf16", [True, False])
def test_before_and_after_decode_at_one_precision(tmp_path, monkeypatch, bf16):
    seen = []
    greedy = evaluate.greedy_completions

    def recording(model, *args, **kwargs):
        wrapped = "_original_forward" in vars(model)  # accelerate's autocast wrapper keeps the original here
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), wrapped))
        return greedy(model, *args, **kwargs)

    monkeypatch.setattr(evaluate, "greedy_completions", recording)
    run = whitebox.run("tiny", {**STILL, "bf16": bf16, "run_dir": str(tmp_path / "r")})
    summary = run.read_summary()
    assert summary["accuracy_precision"] == ("bf16 autocast" if bf16 else "fp32")
    assert len(seen) == 3  # teacher, student before, student after
    assert seen[1] == seen[2] and seen[1][0] is bf16 and not seen[2][2]
    # learning rate 0: the weights never move, so one precision must give one accuracy
    assert summary["student_accuracy_after"] == summary["student_accuracy_before"]
