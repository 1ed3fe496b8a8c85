"""opdkit.tiny.tokenizer: the character tokenizer the tiny world was built with, its Qwen-style chat template
and its generation markers; the shipped `tiny:tokenizer` is what it builds. (The shipped tokenizer's round
trip: test_tiny.py.)"""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from opdkit import tiny
from opdkit.tasks import tiny as tiny_task
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


# The template before tools existed (as shipped until issue 38), kept here to compare against.
TEMPLATE_WITHOUT_TOOLS = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- message['content'] + '<|im_end|>' -}}{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12+7*3"}},
            "required": ["expression"],
        },
    },
}


def conversations_without_tools() -> list[list[dict]]:
    """The tiny task's prompts, its traces (prompt and scratchpad), a system turn, two exchanges."""
    rng = random.Random(5)
    out = []
    for p in tiny_task.problems(40, seed=3):
        prompt = [{"role": "user", "content": p.prompt}]
        trace = [*prompt, {"role": "assistant", "content": tiny_task.scratchpad(p, rng)}]
        out += [prompt, trace, [{"role": "system", "content": "add"}, *trace], trace + trace]
    return out


def test_a_conversation_without_tools_renders_as_before_tools_existed(tiny_tokenizer):
    old = build_tokenizer()
    old.chat_template = TEMPLATE_WITHOUT_TOOLS
    for messages in conversations_without_tools():
        for gen in (False, True):
            if gen and messages[-1]["role"] == "assistant":
                continue
            kw = {"add_generation_prompt": gen, "tokenize": True, "return_dict": True}
            if messages[-1]["role"] == "assistant":
                kw["return_assistant_tokens_mask"] = True
            new_enc = tiny_tokenizer.apply_chat_template(messages, **kw)
            old_enc = old.apply_chat_template(messages, **kw)
            assert new_enc["input_ids"] == old_enc["input_ids"]
            assert tiny_tokenizer.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False
            ) == (old.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False))
            if messages[-1]["role"] == "assistant":
                mask = new_enc["assistant_masks"]
                assert mask == old_enc["assistant_masks"] and any(mask)
                completion = tiny_tokenizer.decode([i for i, m in zip(new_enc["input_ids"], mask) if m])
                assistant = [m["content"] + IM_END for m in messages if m["role"] == "assistant"]
                assert completion == "".join(assistant)


def test_tools_are_listed_compactly_in_a_system_block(tiny_tokenizer):
    tok = tiny_tokenizer
    prompt = [{"role": "user", "content": "390+983+105+772"}]
    two = [CALCULATOR, {"type": "function", "function": {"name": "clock", "parameters": {}}}]
    text = tok.apply_chat_template(prompt, tools=two, add_generation_prompt=True, tokenize=False)
    assert text == (
        f"{IM_START}system\n<tools>\ncalculator(expression)\nclock()\n</tools>{IM_END}\n"
        f"{IM_START}user\n390+983+105+772{IM_END}\n{IM_START}assistant\n"
    )
    with_system = [{"role": "system", "content": "be brief"}, *prompt]
    text = tok.apply_chat_template(
        with_system, tools=[CALCULATOR], add_generation_prompt=False, tokenize=False
    )
    assert text == (
        f"{IM_START}system\nbe brief\n\n<tools>\ncalculator(expression)\n</tools>{IM_END}\n"
        f"{IM_START}user\n390+983+105+772{IM_END}\n"
    )
    # no tools (None or []) renders as without the argument
    for none in (None, []):
        assert tok.apply_chat_template(with_system, tools=none, tokenize=False) == (
            tok.apply_chat_template(with_system, tokenize=False)
        )


def test_tool_calls_and_tool_results_render_as_qwen3_renders_them(tiny_tokenizer):
    tok = tiny_tokenizer
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}
    messages = [
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": ";3"},
    ]
    enc = tok.apply_chat_template(
        messages, tools=[CALCULATOR], return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    call_text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    assert tok.decode(ids) == (
        f"{IM_START}system\n<tools>\ncalculator(expression)\n</tools>{IM_END}\n"
        f"{IM_START}user\n1+2{IM_END}\n"
        f"{IM_START}assistant\n{call_text}{IM_END}\n"
        f"{IM_START}user\n<tool_response>\n3\n</tool_response>{IM_END}\n"
        f"{IM_START}assistant\n;3{IM_END}\n"
    )
    # the loss mask: both assistant turns (the call and the answer), never the tool's result
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"{call_text}{IM_END};3{IM_END}"
    # arguments given as a JSON string, text before the calls, two calls, two results sharing one user turn
    two_calls = {
        "role": "assistant",
        "content": "hm",
        "tool_calls": [
            {"function": {"name": "a", "arguments": '{"x": 1}'}},
            {"type": "function", "function": {"name": "b", "arguments": {}}},
        ],
    }
    text = tok.apply_chat_template(
        [messages[0], two_calls, {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        f"{IM_START}user\n1+2{IM_END}\n{IM_START}assistant\nhm\n"
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
        f"{IM_END}\n{IM_START}user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
        f"{IM_END}\n{IM_START}assistant\n"
    )
    # an assistant turn whose content holds the call as text renders the same as its tool_calls
    as_text = [messages[0], {"role": "assistant", "content": call_text}, *messages[2:]]
    assert tok.apply_chat_template(as_text, tools=[CALCULATOR], tokenize=False) == tok.decode(ids)


def test_a_character_outside_the_vocabulary_is_an_error_not_dropped(tiny_tokenizer):
    shipped = AutoTokenizer.from_pretrained(tiny.resolve("tiny:student"))
    for tok in (tiny_tokenizer, shipped):
        assert tok.decode(tok.encode("12+34 ok")) == "12+34 ok"
        for text in ("12\u00d734", "caf\u00e9", "a\tb", "\u2014"):
            with pytest.raises(Exception, match="outside the tiny vocabulary"):
                tok.encode(text)
        with pytest.raises(Exception, match="outside the tiny vocabulary"):
            tok.apply_chat_template([{"role": "tool", "content": "1\u00b72"}], tokenize=True)
    assert tiny_tokenizer.unk_token is None  # the vocabulary holds no unknown token: nothing maps to one
