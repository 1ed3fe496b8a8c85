"""The tiny world's byte-level BPE tokenizer and the recipe of a teacher on it (opdkit.build.bpe_teacher)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from opdkit.build.bpe_teacher import VOCAB_SIZE, build_bpe_teacher, build_bpe_tokenizer
from opdkit.opd.teachers.cross import TokenBytes, align_ends


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


def test_the_tokenizer_is_byte_level_deterministic_and_cuts_one_digit_a_token(bpe, tiny_tokenizer):
    assert len(bpe) <= VOCAB_SIZE and bpe.get_vocab() == build_bpe_tokenizer().get_vocab()
    assert TokenBytes.of(bpe).kind == "byte-level" and bpe.bos_token is None
    assert (bpe.eos_token, bpe.pad_token) == (tiny_tokenizer.eos_token, tiny_tokenizer.pad_token)
    completion = "8+7=15,5+6+1=12,3+4+1=8;825"
    pieces = bpe.convert_ids_to_tokens(bpe(completion, add_special_tokens=False).input_ids)
    assert pieces == list(
        completion
    )  # digits one a token, symbols apart: the task's text character by character
    assert bpe.convert_ids_to_tokens(bpe("assistant\n", add_special_tokens=False).input_ids) == [
        "assistant",
        "Ċ",
    ]
    assert bpe.decode(bpe(completion + " é🤖").input_ids) == completion + " é🤖"  # any text encodes
    symbols = build_bpe_tokenizer(pieces="symbol-digit")
    pieces = symbols.convert_ids_to_tokens(symbols(completion, add_special_tokens=False).input_ids)
    assert pieces[:5] == ["8", "+7", "=1", "5", ",5"] and pieces[-3:] == [";8", "2", "5"]
    assert all(sum(c.isdigit() for c in p) == 1 for p in pieces)


def test_the_chat_template_marks_the_completion(bpe):
    messages = [{"role": "user", "content": "358+467"}, {"role": "assistant", "content": "8+7=15;825"}]
    out = bpe.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    marked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert bpe.decode(marked) == "8+7=15;825<|im_end|>"


def _groups(student, teacher, text):
    chars, pieces = TokenBytes.of(student), TokenBytes.of(teacher)
    s_ids = student(text, add_special_tokens=False).input_ids
    t = pieces.tokenize(teacher, chars.text(s_ids), teacher.eos_token_id)
    groups = align_ends(chars.ends(s_ids), t.byte_ends[:-1])
    assert [k for g, _ in groups for k in g] == list(range(len(s_ids)))
    return groups


def test_the_character_student_and_the_bpe_teacher_align(bpe, tiny_tokenizer):
    groups = _groups(tiny_tokenizer, bpe, "assistant\n8+7=15;825")
    assert [(len(s), len(g)) for s, g in groups] == [(9, 1)] + [(1, 1)] * 11  # "assistant": one BPE token
    symbols = build_bpe_tokenizer(pieces="symbol-digit")
    groups = _groups(tiny_tokenizer, symbols, "8+7=15,5+6+1=12,3+4+1=8;825")
    assert any(len(s) == 2 and len(g) == 1 for s, g in groups)  # "+7": two characters, one BPE token


def test_the_recipe_runs_a_few_steps(tmp_path):
    rec = build_bpe_teacher(tmp_path, steps=3, eval_every=2)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size == len(build_bpe_tokenizer())
    assert set(rec) >= {"teacher_heldout_accuracy", "build_seconds"}
    assert json.loads((tmp_path / "recipe.json").read_text())["teacher"]["history"][0]["step"] == 2
