"""opdkit.opd.teachers.local: a teacher in process answers every call; its loss is the divergence computed
from full logits at the positions the loss mask marks."""

from __future__ import annotations

import pytest
import torch
from helpers import answers_every_call, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd.loss import per_token_divergence
from opdkit.opd.teachers.local import LocalTeacher


def test_a_teacher_in_process_answers_every_call_with_the_full_logits_divergence(tmp_path):
    tok = load_tokenizer("tiny:student")
    kind = LocalTeacher(tiny_model("tiny:teacher"))
    got = answers_every_call(kind, tok, tmp_path)
    assert kind.exact and got["metrics"] == {} and got["fingerprint"] is None and got["sums"] is None
    assert float(got["n"]) == got["out"].per_token_N.shape[0]
    assert got["out"].per_token_N.sum() > 0 and not kind.sharded


def test_the_divergence_per_token_is_the_full_logits_one(tmp_path):
    """The chunked states-and-head divergence against `per_token_divergence` of the two models' logits."""
    from helpers import tiny_rollout

    from opdkit.opd.teachers.base import DivergenceInputs
    from opdkit.rollout import sampling, source

    tok = load_tokenizer("tiny:student")
    teacher, student = tiny_model("tiny:teacher"), tiny_model("tiny:student")
    record = source.record_of(tiny_rollout(teacher, tok), [tok.eos_token_id])
    pred_BT = record.predicting_BT()
    fwd = dict(
        input_ids=record.input_ids_BT,
        attention_mask=record.attention_mask_BT,
        position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
    )
    kind = LocalTeacher(teacher)
    given = DivergenceInputs(beta=0.5, temperature=1.3, vocab_size=len(tok), chunk_size=7)
    with torch.no_grad():
        part = kind.score(record, None, fwd, pred_BT)
        out, _ = kind.output(kind.student_divergence(student, fwd, pred_BT, part, given), record, part)
        want_N = per_token_divergence(
            student(**fwd).logits[pred_BT], teacher(**fwd).logits[pred_BT], beta=0.5, temperature=1.3
        )
    torch.testing.assert_close(out.per_token_N, want_N, rtol=1e-5, atol=1e-6)
    assert float(out.sum) == pytest.approx(float(want_N.sum()), rel=1e-5)
