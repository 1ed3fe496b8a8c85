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


def test_with_an_environment_the_summary_reports_greedy_episodes_and_their_tool_calls(tmp_path):
    """tiny-tools: the accuracies are greedy episodes' with the calculator, the teacher's and the student's as
    played and graded by hand (helpers.tool_episode_by_hand); eval_every logs the tool share."""
    import json

    from helpers import tool_episode_by_hand as by_hand

    from opdkit.models import load_model, load_tokenizer
    from opdkit.tasks import tinytools

    over = {**STILL, "run_dir": str(tmp_path / "r"), "eval_size": 6, "eval_every": 1, "eval_every_size": 3}
    over.pop("rollout_max_new_tokens")  # the preset's: a turn long enough for the call
    run = whitebox.run("tiny-tools", over)
    summary = run.read_summary()
    tok = load_tokenizer("tiny:teacher-tools")
    teacher = load_model("tiny:teacher-tools", torch.float32, "cpu").eval()
    messages, answers = tinytools.TinyToolsTask().heldout(6)
    hand = [by_hand(teacher, tok, m[0]["content"], a) for m, a in zip(messages, answers)]
    assert summary["teacher_accuracy"] == pytest.approx(sum(h[0] for h in hand) / 6)
    assert summary["teacher_tool_call_share"] == pytest.approx(sum(h[1] for h in hand) / 6)
    for when in ("before", "after"):  # learning rate 0: the shipped student, which never calls
        assert (
            summary[f"student_accuracy_{when}"] == 0.0 and summary[f"student_tool_call_share_{when}"] == 0.0
        )
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert evals and all(r["eval_tool_call_share"] == 0.0 for r in evals)
    assert any("tool/call_correct_share" in r for r in rows)
