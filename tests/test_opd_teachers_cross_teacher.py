"""opdkit.opd.teachers.cross.teacher: a teacher with another tokenizer answers every call: its rows are its
own tokens, the step's loss is a mean over its groups, and it gives no entropy."""

from __future__ import annotations

from helpers import answers_every_call, args, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd.teachers.cross import CrossTokenizerTeacher
from opdkit.opd.teachers.local import LocalTeacher


def test_a_teacher_with_another_tokenizer_answers_every_call(tmp_path):
    tok, bpe = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    kind = CrossTokenizerTeacher(LocalTeacher(tiny_model("tiny:teacher-bpe")), tok, bpe, args(tmp_path))
    got = answers_every_call(kind, tok, tmp_path)
    assert kind.tokenizer is bpe and not kind.gives_entropy
    assert got["out"].student_entropy_N.abs().sum() == 0
    # the mean is over the alignment's groups, each closed on one student token
    assert 0 < float(got["n"]) <= got["out"].per_token_N.shape[0]
    assert int((got["out"].per_token_N != 0).sum()) <= float(got["n"])
    assert "cross-tokenizer loss" in kind.describe("tiny:teacher-bpe")
