"""opdkit.opd.teachers.served.teacher: a served teacher answers every call with the in-process teacher's
divergence; with a reference in process it checks the served states x head on its first steps and logs the
gap."""

from __future__ import annotations

import pytest
from helpers import StubPoolingServer, answers_every_call, pooling_client, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd.teachers import served
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.opd.teachers.served.head import load_head


def test_a_served_teacher_answers_every_call_as_the_teacher_in_process(tmp_path):
    tok, teacher = load_tokenizer("tiny:student"), tiny_model("tiny:teacher")
    want = answers_every_call(LocalTeacher(teacher), tok, tmp_path / "local")
    with StubPoolingServer(teacher) as stub:
        kind = served.ServedTeacher(
            pooling_client(stub.url), load_head("tiny:teacher"), served_dtype="float32", reference=teacher
        )
        got = answers_every_call(kind, tok, tmp_path / "served")
        assert len(stub.pooling_requests) == 1  # the step's rows, prepared in one request
    assert float(got["out"].sum.detach()) == pytest.approx(float(want["out"].sum.detach()), rel=1e-5)
    gap, tokens = got["sums"].tolist()
    assert tokens == got["out"].per_token_N.shape[0] and gap / tokens < 1e-5  # the first step was checked
    assert got["metrics"]["teacher_logprob_gap"] < 1e-5 and kind.exact and kind.module is kind


def test_a_wrong_head_stops_the_first_step(tmp_path):
    tok, teacher = load_tokenizer("tiny:student"), tiny_model("tiny:teacher")
    head = load_head("tiny:teacher")
    head.weight_VH = head.weight_VH * 1.5
    with StubPoolingServer(teacher) as stub:
        kind = served.ServedTeacher(pooling_client(stub.url), head, "float32", reference=teacher)
        with pytest.raises(served.ServedTeacherMismatch, match="teacher_logprob_gap .* at step 1"):
            answers_every_call(kind, tok, tmp_path)
