"""opdkit.opd.teachers.base: every teacher kind answers every call of the interface (`answers_every_call`, run
by each kind's own test file on its kind), and `teachers.of` picks the kind of each teacher module."""

from __future__ import annotations

import pytest
from helpers import LogitsClient, args, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd import mixture, topk
from opdkit.opd.teachers import of
from opdkit.opd.teachers.base import Teacher
from opdkit.opd.teachers.cross import CrossTokenizerTeacher
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.opd.teachers.sets import Routed, Weighted
from opdkit.opd.teachers.topk import TopK


def test_of_picks_each_teacher_modules_kind(tmp_path):
    tok, bpe = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    t = tiny_model("tiny:teacher")
    assert type(of(t, tok)) is LocalTeacher
    assert type(of(topk.TopKTeacher(LogitsClient(t), 3), tok)) is TopK
    assert type(of(mixture.RoutedTeacher({"a": t}), tok)) is Routed
    assert type(of(mixture.WeightedTeachers({"a": t}, {"a": 1.0}), tok)) is Weighted
    kind = LocalTeacher(t)
    assert of(kind, tok) is kind  # a kind is taken as it is
    cross = of(tiny_model("tiny:teacher-bpe"), tok, bpe, args(tmp_path))
    assert type(cross) is CrossTokenizerTeacher and type(cross.inner) is LocalTeacher
    with pytest.raises(ValueError, match="topk needs a teacher with the student's tokenizer"):
        of(topk.TopKTeacher(LogitsClient(t), 3), tok, bpe, args(tmp_path))
    with pytest.raises(ValueError, match="several teachers need the student's tokenizer"):
        of(mixture.RoutedTeacher({"a": t}), tok, bpe, args(tmp_path))


def test_a_kind_must_score_and_give_the_students_side():
    class Half(Teacher):
        def plan_rows(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half()
