"""opdkit.opd.teachers.base: every teacher kind answers every call of the interface (`answers_every_call`, run
by each kind's own test file on its kind), every kind has a name, and `teachers.of` takes a kind as it is and
any other module as a teacher in process."""

from __future__ import annotations

import pytest
from helpers import LogitsClient, args, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd.teachers import of, sets, topk
from opdkit.opd.teachers.base import Teacher
from opdkit.opd.teachers.cross import CrossTokenizerTeacher
from opdkit.opd.teachers.local import LocalTeacher


def test_of_takes_a_kind_as_it_is_and_a_module_as_a_teacher_in_process(tmp_path):
    tok, bpe = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    t = tiny_model("tiny:teacher")
    assert type(of(t, tok)) is LocalTeacher
    for kind in (
        LocalTeacher(t),
        topk.TopKTeacher(LogitsClient(t), 3),
        sets.RoutedTeacher({"a": t}),
        sets.WeightedTeachers({"a": t}, {"a": 1.0}),
    ):
        assert of(kind, tok) is kind and kind.module is not None
    cross = of(tiny_model("tiny:teacher-bpe"), tok, bpe, args(tmp_path))
    assert type(cross) is CrossTokenizerTeacher and type(cross.inner) is LocalTeacher
    with pytest.raises(ValueError, match="topk needs a teacher with the student's tokenizer"):
        of(topk.TopKTeacher(LogitsClient(t), 3), tok, bpe, args(tmp_path))
    with pytest.raises(ValueError, match="several teachers need the student's tokenizer"):
        of(sets.RoutedTeacher({"a": t}), tok, bpe, args(tmp_path))


def test_a_kind_must_score_and_give_the_students_side():
    class Half(Teacher):
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_every_kind_has_a_name():
    """`Teacher.name` is declared by the interface and set by every kind (the trainer's errors read it)."""
    from opdkit.ads.teacher import ADSTeacher
    from opdkit.opd.teachers.served import ServedTeacher

    kinds = [LocalTeacher, ServedTeacher, topk.TopKTeacher, CrossTokenizerTeacher, ADSTeacher]
    kinds += [sets.RoutedTeacher, sets.WeightedTeachers]
    names = [k.name for k in kinds]
    assert all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
    assert "name" in Teacher.__annotations__
