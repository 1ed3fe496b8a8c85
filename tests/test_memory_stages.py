"""Tests for opdkit.memory.stages: the teacher's tokens per student token, counted by hand on stand-in
tokenizers and bounded at 1 for a teacher that cuts coarser; 02 tiny-crosstok's, from its tokenizers."""

from __future__ import annotations

from types import SimpleNamespace

from opdkit import memory
from opdkit.config import load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.models import load_tokenizer
from opdkit.opd.stage import distill_stage


class _Split:
    """A stand-in tokenizer: one token per character, or per whitespace-separated word."""

    def __init__(self, by_char: bool):
        self.by_char = by_char

    def __call__(self, text: str, add_special_tokens: bool = True):
        pieces = list(text) if self.by_char else text.split()
        return SimpleNamespace(input_ids=list(range(len(pieces))))


def test_token_ratio_is_the_most_teacher_tokens_per_student_token():
    # "ab cd": 5 characters over 2 words; "x y z": 5 over 3; "abcd": 4 over 1, the most.
    ratio = memory.token_ratio(_Split(by_char=False), _Split(by_char=True), ("ab cd", "x y z", "abcd"))
    assert ratio == 4.0
    # A teacher that cuts coarser reads fewer tokens: planned at the student's count.
    assert memory.token_ratio(_Split(by_char=True), _Split(by_char=False), ("ab cd",)) == 1.0


def test_tiny_crosstok_plans_its_teacher_at_the_ratio_its_tokenizers_give():
    """02 tiny-crosstok: the character student and the byte-level BPE teacher, measured on `TOKEN_SAMPLE`. The
    character student refuses the non-ASCII sample (outside its vocabulary), where the BPE teacher would cut
    finer; on the rest the BPE teacher cuts coarser, so it is planned at the student's count."""
    cfg = load_config(WhiteboxConfig, "tiny-crosstok", {})
    stage = distill_stage(cfg, 1, None)
    student, teacher = load_tokenizer(cfg.student_model), load_tokenizer(cfg.teacher_model)
    ratio = memory.token_ratio(student, teacher)
    assert stage.cross_tokenizer and stage.teacher_token_ratio == ratio == 1.0
    ascii_only = tuple(t for t in memory.TOKEN_SAMPLE if t.isascii())
    assert len(ascii_only) == len(memory.TOKEN_SAMPLE) - 1  # the one text the student cannot read
    assert memory.token_ratio(student, teacher, ascii_only) == 1.0
    assert memory.token_ratio(teacher, student, ascii_only) > 1.0  # the other way round: the student finer
    assert distill_stage(load_config(WhiteboxConfig, "tiny", {}), 1, None).teacher_token_ratio == 1.0


def test_the_prepared_tokenizers_plan_what_loading_them_plans():
    """A job's prepare hands its tokenizers to the plan (not loaded again): the same stage as the plan that
    loads them, for a teacher with another tokenizer and for one with the student's."""
    from opdkit.jobs import whitebox

    for mode in ("tiny-crosstok", "tiny"):
        prep = whitebox.prepare(mode, {"subset_size": 64, "eval_size": 8})
        given = distill_stage(prep.cfg, 1, None, (prep.tokenizer, prep.teacher_tokenizer))
        assert given == distill_stage(prep.cfg, 1, None)
        assert given.cross_tokenizer == (mode == "tiny-crosstok")
