"""opdkit.tiny.tokenizer: the character tokenizer the tiny world was built with, its Qwen-style chat template
and its generation markers; the shipped `tiny:tokenizer` is what it builds. (The shipped tokenizer's round
trip: test_tiny.py.)"""

from __future__ import annotations

from transformers import AutoTokenizer

from opdkit import tiny
from opdkit.tiny.tokenizer import CHARS, IM_END, IM_START, PAD, SPECIALS, build_tokenizer


def test_the_shipped_tokenizer_is_the_one_built_here(tiny_tokenizer):
    shipped = AutoTokenizer.from_pretrained(tiny.resolve("tiny:tokenizer"))
    assert shipped.get_vocab() == tiny_tokenizer.get_vocab() and len(shipped) == len(SPECIALS) + len(CHARS)
    assert shipped.chat_template == tiny_tokenizer.chat_template
    text = "<|im_start|>user\n358+467<|im_end|>\n"
    assert shipped.encode(text) == tiny_tokenizer.encode(text)


def test_one_token_per_character_and_one_per_special(tiny_tokenizer):
    tok = tiny_tokenizer
    text = "".join(CHARS)
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("9+9+1=19")) == list("9+9+1=19")
    for special in SPECIALS:
        assert tok.encode(special) == [tok.convert_tokens_to_ids(special)]
    assert tok.convert_ids_to_tokens(tok.encode("<think>x</think>")) == ["<think>", "x", "</think>"]


def test_like_qwen3_no_bos_pads_with_endoftext_and_ends_a_turn_with_im_end(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.bos_token is None and tok.encode("1+2") == tok.encode("1+2", add_special_tokens=False)
    assert (tok.pad_token, tok.eos_token, tok.padding_side) == (PAD, IM_END, "left")
    assert tok.pad_token_id != tok.eos_token_id


def test_the_chat_template_renders_qwen_turns_and_marks_the_completion(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = [{"role": "user", "content": "1+2"}]
    rendered = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    assert rendered == f"{IM_START}user\n1+2{IM_END}\n{IM_START}assistant\n"
    thinking = tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert thinking == rendered  # accepted and ignored
    messages = [
        {"role": "system", "content": "be brief"},
        *prompt,
        {"role": "assistant", "content": "2+1=3;3"},
    ]
    enc = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    start = mask.index(1)
    assert tok.decode(ids[:start]) == f"{IM_START}system\nbe brief{IM_END}\n" + rendered
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "2+1=3;3" + IM_END
    assert tok.decode(ids[start + sum(mask) :]) == "\n"  # after the turn: not the completion


def test_it_saves_and_loads_like_any_tokenizer(tmp_path):
    build_tokenizer().save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    fresh = build_tokenizer()
    assert loaded.encode("12+34") == fresh.encode("12+34") and loaded.chat_template == fresh.chat_template
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == (IM_END, PAD, None)
