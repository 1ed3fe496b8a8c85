"""opdkit.opd.teachers.topk.teacher: a top-K teacher answers every call, says it is approximate, and refuses
another temperature than 1 at start."""

from __future__ import annotations

import pytest
from helpers import LogitsClient, answers_every_call, args, tiny_model

from opdkit.models import load_tokenizer
from opdkit.opd.teachers import topk


def test_a_topk_teacher_answers_every_call_and_is_labelled_approximate(tmp_path):
    tok = load_tokenizer("tiny:student")
    kind = topk.TopKTeacher(LogitsClient(tiny_model("tiny:teacher")), 4)
    got = answers_every_call(kind, tok, tmp_path)
    assert not kind.exact and got["metrics"] == {"teacher_logprobs": "topk:4 (approximate)"}
    assert kind.module is kind and not list(kind.parameters())  # this process holds none of it
    with pytest.raises(ValueError, match="kl_temperature=2.0"):
        kind.start(tiny_model("tiny:student"), tok, args(tmp_path, kl_temperature=2.0))
