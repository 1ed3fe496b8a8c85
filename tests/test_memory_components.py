"""Tests for opdkit.memory.components: what the plan counts of a teacher set, of a teacher that reads its
own token count, of the cross-tokenizer backward's head gradient, and of 02's student evaluation under
autocast, each against a count by hand (Qwen3's published configs) or from the models themselves (the tiny
world)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import HAND_PARAMS, QWEN3

from opdkit import memory
from opdkit.config import load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.memory import ModelShape, SetMemberShape, Stage, plan
from opdkit.models import load_model
from opdkit.opd.stage import distill_stage

VOCAB = 151936
P, C, B = 1024, 1024, 4  # prompt and completion tokens, training rows


def _stage(**change) -> Stage:
    base = Stage(
        bf16=True,
        student=ModelShape.from_config(QWEN3["Qwen3-0.6B"]),
        teacher=ModelShape.from_config(QWEN3["Qwen3-8B"]),
        train_batch_size=B,
        sampled_rows=16,
        eval_batch_size=32,
        prompt_len=P,
        completion_len=C,
    )
    return dataclasses.replace(base, **change)


def _rows(stage: Stage) -> dict[str, memory.Component]:
    return {r.component: r for r in plan(stage).rows}


def test_every_teacher_of_a_set_is_planned():
    """Qwen3-8B first, then 4B in process and 1.7B served, routed: the 4B's weights, the 1.7B's head and
    states, the three heads stacked, and every teacher's final states in training (bf16 teachers)."""
    others = (
        SetMemberShape(ModelShape.from_config(QWEN3["Qwen3-4B"])),
        SetMemberShape(ModelShape.from_config(QWEN3["Qwen3-1.7B"]), served=True),
    )
    one, routed = _rows(_stage()), _rows(_stage(other_teachers=others, teachers_routed=True))
    assert routed["teacher weights"].bytes == one["teacher weights"].bytes == HAND_PARAMS["Qwen3-8B"] * 2
    assert routed["teacher 2 weights"].bytes == HAND_PARAMS["Qwen3-4B"] * 2
    assert routed["teacher 3 head (served teacher)"].bytes == VOCAB * 2048 * 2
    assert routed["served teacher 3 states"].bytes == B * (P + C) * 2048 * 2
    assert routed["stacked teachers' head"].bytes == VOCAB * (4096 + 2560 + 2048) * 2
    # The states at the predicted positions: B x C rows of the 4B's and the 1.7B's hidden sizes more.
    assert routed["activations"].bytes - one["activations"].bytes == B * C * (2560 + 2048) * 2
    weighted = _rows(_stage(other_teachers=others))  # teacher_weights: no stacked head
    assert "stacked teachers' head" not in weighted and "teacher 2 weights" in weighted


def test_a_whitebox_teacher_set_plans_each_teacher_it_loads(tmp_path):
    """02 with `teachers` (two in process, weighted): the plan's second teacher is what loading it holds."""
    cfg = load_config(
        WhiteboxConfig,
        "tiny",
        {"teachers": "a=tiny:teacher,b=tiny:student", "teacher_weights": "a=0.5,b=0.5", "bf16": False},
    )
    stage = distill_stage(cfg, 1, None)
    assert [t.served for t in stage.other_teachers] == [False] and not stage.teachers_routed
    second = load_model("tiny:student", torch.float32, "cpu")
    held = sum(p.numel() * p.element_size() for p in second.parameters())
    assert _rows(stage)["teacher 2 weights"].bytes == held
    assert stage.eval_model == "student" and not stage.eval_student  # no teacher of a set is evaluated


def test_a_teacher_that_cuts_finer_is_planned_at_its_own_token_count():
    """teacher_token_ratio 1.5: the teacher's final states at 1.5 x the student's B x C tokens."""
    base, finer = _rows(_stage()), _rows(_stage(teacher_token_ratio=1.5))
    assert finer["activations"].bytes - base["activations"].bytes == (B * C // 2) * 4096 * 2
    served = dict(teacher_served=True, teacher_token_ratio=1.5)
    assert _rows(_stage(**served))["served teacher states"].bytes == 3 * B * (P + C) // 2 * 4096 * 2
    with pytest.raises(ValueError, match="below 1"):
        _stage(teacher_token_ratio=0.5)


def test_the_cross_tokenizer_backward_head_gradient_is_planned():
    """The backward pass returns the student head's gradient whole: 151,936 x 1,024 x 4 B for the fp32
    Qwen3-0.6B; none when LoRA leaves the head frozen."""
    rows = _rows(_stage(cross_tokenizer=True))
    assert rows["cross-tokenizer head gradient"].bytes == VOCAB * 1024 * 4
    assert rows["cross-tokenizer head gradient"].phase == "train"
    lora = _rows(_stage(cross_tokenizer=True, trainable_params=10_000_000))
    assert "cross-tokenizer head gradient" not in lora
    assert "cross-tokenizer head gradient" not in _rows(_stage())


def test_the_students_evaluation_under_autocast_is_planned_in_a_phase_of_its_own():
    """The fp32 Qwen3-0.6B decoded under bf16 autocast keeps K in fp32 and V in bf16: 28 layers x 8 KV heads
    x 128 x (4 + 2) B per token, for 32 rows of P + C tokens; a phase apart from the teacher's evaluation."""
    p = plan(_stage(eval_student=True))
    rows = {r.component: r for r in p.rows}
    kv = rows["KV cache, student evaluation"]
    assert kv.bytes == 32 * (P + C) * 28 * 8 * 128 * (4 + 2) and kv.phase == "student-eval"
    totals = p.phase_totals()
    teacher_eval = sum(r.bytes for r in p.rows if r.phase == "eval")
    student_eval = sum(r.bytes for r in p.rows if r.phase == "student-eval")
    assert totals["student-eval"] - student_eval == totals["eval"] - teacher_eval  # the same always rows
    assert "KV cache, student evaluation" not in _rows(_stage())


@pytest.mark.parametrize("engine, evaluated", [("hf", True), ("vllm", False)])
def test_02_plans_its_students_evaluation_on_the_kits_loop_only(engine, evaluated):
    cfg = load_config(WhiteboxConfig, "tiny", {"rollout_engine": engine})
    stage = distill_stage(cfg, 1, 80.0)
    assert stage.eval_model == "teacher" and stage.eval_student == evaluated
