"""Tests for opdkit.opd.teachers.cross.alignment: the two-pointer walk over byte ends on real tokenizers
(Qwen3, DeepSeek, the tiny world's character tokenizer): every group spells the same bytes on both sides."""

from __future__ import annotations

import pytest
from helpers import CROSSTOK_TEXTS as TEXTS

from opdkit.opd.teachers.cross import (
    TokenBytes,
    align_ends,
)


@pytest.mark.parametrize("text", TEXTS)
def test_groups_hold_the_same_bytes_on_both_sides(qwen3_bytes, deepseek_bytes, text):
    (q, qb), (d, db) = qwen3_bytes, deepseek_bytes
    s, t = qb.tokenize(q, text), db.tokenize(d, text)
    groups = align_ends(s.byte_ends, t.byte_ends)
    assert [k for g, _ in groups for k in g] == list(range(len(s.ids)))
    assert [k for _, g in groups for k in g] == list(range(len(t.ids)))
    for s_idx, t_idx in groups:
        s_bytes = b"".join(qb.pieces[s.ids[k]] for k in s_idx)
        t_bytes = b"".join(db.pieces[t.ids[k]] for k in t_idx)
        assert s_bytes == t_bytes and s_bytes
    if len(text) > 10:  # the two tokenizers cut differently somewhere: some group has several tokens
        assert any(len(a) > 1 or len(b) > 1 for a, b in groups)


def test_inside_ends_close_no_group():
    # Two teacher tokens inside one 4-byte character (2e-1 for the first): the student's token ending at the
    # character's end pairs with both.
    groups = align_ends([8, 10], [7, 8, 10])
    assert groups == [([0], [0, 1]), ([1], [2])]


def test_the_tiny_character_tokenizer_is_exact(tiny_tokenizer, qwen3_bytes):
    table = TokenBytes.of(tiny_tokenizer)
    assert table.kind == "characters"
    text = "12+345=357\n<think>"
    ids = tiny_tokenizer(text, add_special_tokens=False).input_ids
    assert table.text(ids) == "12+345=357\n"  # <think> is a special token of the tiny world: zero width
    q, qb = qwen3_bytes
    t = qb.tokenize(q, table.text(ids))
    groups = align_ends(table.ends(ids), t.byte_ends)
    assert all(len(s) >= 1 and len(g) == 1 for s, g in groups)  # Qwen3 merges, characters never split
