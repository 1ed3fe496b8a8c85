"""Tests for opdkit.opd.teachers.cross.tokenbytes: byte offsets of real tokenizers (Qwen3, DeepSeek) on emoji,
CJK and multi-byte text, a completion cut inside a character, the character-offset fallback, refused
tokenizers, and the shared vocabulary."""

from __future__ import annotations

import pytest
from helpers import CROSSTOK_TEXTS as TEXTS
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from opdkit.config import ConfigError
from opdkit.opd.teachers.cross import (
    CrossTokenizerSettings,
    TokenBytes,
    Tokens,
    VocabMatch,
    align,
    align_ends,
)


@pytest.mark.parametrize("which", ["qwen3_bytes", "deepseek_bytes"])
@pytest.mark.parametrize("text", TEXTS)
def test_byte_ends_spell_the_text(request, which, text):
    tok, table = request.getfixturevalue(which)
    assert table.kind == "byte-level"
    ids = tok(text, add_special_tokens=False).input_ids
    pieces = [table.pieces[i] for i in ids]
    assert b"".join(pieces) == text.encode() and table.text(ids) == text
    ends = table.ends(ids)
    assert ends[-1] == 2 * len(text.encode()) and all(e % 2 == 0 for e in ends)
    # A multi-byte character split over tokens: some token ends inside it (its bytes are not valid UTF-8).
    if "🤖" in text:
        assert any(not _valid_utf8(p) for p in pieces)
    t = table.tokenize(tok, text, tok.eos_token_id)
    assert t.ids == [*ids, tok.eos_token_id] and t.byte_ends == [*ends, ends[-1]]


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_a_completion_cut_inside_a_character(qwen3_bytes, deepseek_bytes):
    """The student's last token ends inside an emoji: the teacher reads the text up to the last whole
    character; tokens after the last byte end both sides share take no part (GOLD would pair them)."""
    (q, qb), (d, db) = qwen3_bytes, deepseek_bytes
    ids = q("ok 🤖", add_special_tokens=False).input_ids
    cut = ids[:-1]  # ends inside the emoji
    assert not _valid_utf8(b"".join(qb.pieces[i] for i in cut)) and qb.text(cut) == "ok "
    t = db.tokenize(d, qb.text(cut), d.eos_token_id)
    s = Tokens(cut, qb.ends(cut))
    groups = align_ends(s.byte_ends, t.byte_ends)
    assert groups == [([0], [0])]  # "ok"; the student's " \xf0\x9f" ends past the teacher's " "
    plan = align([s], [t], CrossTokenizerSettings(), teacher_eos=d.eos_token_id)
    assert plan.num_groups == 1


def test_a_normalized_text_falls_back_to_character_offsets(qwen3_bytes):
    """Qwen3's tokenizer applies NFC: a decomposed é comes back as one precomposed character, so its tokens do
    not spell the text; the ends then come from the character offsets, still non-decreasing."""
    q, qb = qwen3_bytes
    text = "cafe\u0301 ok"
    t = qb.tokenize(q, text)
    assert b"".join(qb.pieces[i] for i in t.ids) != text.encode()
    assert t.byte_ends == sorted(t.byte_ends) and t.byte_ends[-1] == 2 * len(text.encode())


def test_other_tokenizers_are_refused():
    core = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ConfigError, match="positional"):
        TokenBytes.of(PreTrainedTokenizerFast(tokenizer_object=core))


def test_vocab_match_is_by_exact_string(qwen3_bytes, deepseek_bytes):
    (q, _), (d, _) = qwen3_bytes, deepseek_bytes
    match = VocabMatch.of(q, d)
    assert 50_000 < len(match) < min(len(q), len(d))
    q_vocab = {i: s for s, i in q.get_vocab().items()}
    d_vocab = {i: s for s, i in d.get_vocab().items()}
    for s_id, t_id in list(zip(match.student_ids_S.tolist(), match.teacher_ids_S.tolist()))[::5000]:
        assert q_vocab[s_id] == d_vocab[t_id]
    assert match.teacher_ids_S.tolist() == sorted(match.teacher_ids_S.tolist())


def test_vocab_match_by_bytes_pairs_tokens_that_spell_the_same_text():
    """crosstok_match=bytes: the tiny character tokenizer and byte-level BPE share every token that spells the
    same text (decoded by each tokenizer), whitespace included ('\\n' and 'Ċ'), special tokens by name; by
    string the whitespace is not shared."""
    from opdkit.models import load_tokenizer

    student, teacher = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    by_string = VocabMatch.of(student, teacher)
    by_bytes = VocabMatch.of(student, teacher, (TokenBytes.of(student), TokenBytes.of(teacher)))
    pairs = set(zip(by_bytes.student_ids_S.tolist(), by_bytes.teacher_ids_S.tolist()))
    assert set(zip(by_string.student_ids_S.tolist(), by_string.teacher_ids_S.tolist())) < pairs
    specials = set(student.all_special_ids)
    for s, t in pairs:
        if s in specials:
            assert student.convert_ids_to_tokens(s) == teacher.convert_ids_to_tokens(t)
        else:
            assert student.decode([s]) == teacher.decode([t])
    newline, space = student.convert_tokens_to_ids("\n"), student.convert_tokens_to_ids(" ")
    assert (newline, teacher.convert_tokens_to_ids("Ċ")) in pairs
    assert (space, teacher.convert_tokens_to_ids("Ġ")) in pairs
    # every text one token spells on both sides is shared exactly once
    s_text = {student.decode([i]): i for i in range(len(student)) if i not in specials}
    t_text = {teacher.decode([i]) for i in range(len(teacher)) if i not in set(teacher.all_special_ids)}
    assert len(pairs) == len(set(s_text) & t_text) + len(specials & set(by_string.student_ids_S.tolist()))
    assert len({t for _, t in pairs}) == len(pairs) == len({s for s, _ in pairs})
