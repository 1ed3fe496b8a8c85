"""opdkit.opd.teachers.sets: routed and weighted teacher sets answer every call; each teacher's divergence is
a metric of its own, and a resume with another set is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import answers_every_call, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd.teachers import sets


def _other_teacher() -> torch.nn.Module:
    t = tiny_model("tiny:teacher")
    with torch.no_grad():
        t.lm_head.weight.mul_(1.5)
    return t


def test_a_routed_set_answers_every_call_and_logs_each_teachers_rows(tmp_path):
    tok = load_tokenizer("tiny:student")
    kind = sets.RoutedTeacher({"a": tiny_model("tiny:teacher"), "b": _other_teacher()})
    owners = lambda r: ["a" if b % 2 else "b" for b in range(r.input_ids_BT.shape[0])]  # noqa: E731
    got = answers_every_call(kind, tok, tmp_path, teacher_ids=owners)
    sums = got["sums"].tolist()
    assert sums[2] + sums[3] == got["out"].per_token_N.shape[0] and min(sums[2:]) > 0
    assert sums[0] + sums[1] == pytest.approx(float(got["out"].per_token_N.sum()), rel=1e-6)
    assert set(got["metrics"]) == {"divergence/a", "divergence/b"}
    assert set(got["fingerprint"]["teachers"]) == {"a", "b"}


def test_a_weighted_set_answers_every_call_and_refuses_another_set_at_a_resume(tmp_path):
    tok = load_tokenizer("tiny:student")
    pair = {"a": tiny_model("tiny:teacher"), "b": _other_teacher()}
    kind = sets.WeightedTeachers(pair, {"a": 0.7, "b": 0.3})
    got = answers_every_call(kind, tok, tmp_path)
    n = got["out"].per_token_N.shape[0]
    assert got["sums"].tolist()[2:] == [n, n] and kind.module is kind
    other = sets.WeightedTeachers({"a": _other_teacher()}, {"a": 1.0})
    probe = tok("12+34=46", add_special_tokens=False)["input_ids"]
    with pytest.raises(sets.TeacherSetMismatch):
        kind.check_same(got["fingerprint"], other.fingerprint(probe))
