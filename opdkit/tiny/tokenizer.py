"""A character-level Hugging Face tokenizer with a Qwen-style chat template.

Built with `tokenizers` (a BPE model with no merges is a character model) and wrapped in
`PreTrainedTokenizerFast`, so it saves and loads through `AutoTokenizer` like any real one. Like
Qwen3 it has no BOS token, pads with ``<|endoftext|>`` and ends a turn with ``<|im_end|>``; the
assistant turn sits inside ``{% generation %}`` markers so `apply_chat_template(...,
return_assistant_tokens_mask=True)` finds the completion.

Tools render as Qwen3 renders them, compacted for models of 256 positions: `apply_chat_template(messages,
tools=[schema, ...])` lists each tool as ``name(arg, ...)`` in a system block (``<tools>`` ... ``</tools>``,
after the conversation's own system message when it starts with one); an assistant's `tool_calls` are
``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` inside its generation block; a `tool`
message is ``<tool_response>\n...\n</tool_response>`` in a user turn (consecutive ones share it). A
conversation without tools, tool calls or tool messages renders exactly as before tools existed.

A character outside the vocabulary (printable ASCII but tab, CR, VT, FF) is an error, not silently dropped:
the character model's unknown token (`OUTSIDE`) is not in the vocabulary, so `tokenizers` refuses the text
("Unk token `<unk: a character outside the tiny vocabulary>` not found in the vocabulary") while the
vocabulary, and so the shipped models, stay as they are.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [PAD, IM_START, IM_END, "<think>", "</think>"]
CHARS = sorted(set(string.printable) - set("\t\r\x0b\x0c"))

# enable_thinking is accepted and ignored: the tiny world has no thinking mode.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '<tools>' -}}"
    "{%- for tool in tools -%}"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set props = (fn['parameters'] or {})['properties'] or {} -%}"
    "{{- '\\n' + fn['name'] + '(' + (props | list | join(', ')) + ')' -}}"
    "{%- endfor -%}"
    "{{- '\\n</tools><|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}"
    "{{- message['content'] if message['content'] is string else '' -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- if not loop.first or message['content'] -%}{{- '\\n' -}}{%- endif -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    "{%- if call['arguments'] is string -%}{{- call['arguments'] -}}"
    "{%- else -%}{{- call['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{% endgeneration %}"
    "{{- '\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# The character model's unknown token: deliberately not in the vocabulary, so a character outside it is an
# error of `tokenizers` (this name in its message) instead of being dropped.
OUTSIDE = "<unk: a character outside the tiny vocabulary>"


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True, unk_token=OUTSIDE))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    return wrap(core)


def wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    """A `tokenizers` core as the tiny world's transformers tokenizer: its specials, left padding, the chat
    template (the character tokenizer here, the BPE teacher's in `opdkit.build.bpe_teacher`)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        bos_token=None,
        additional_special_tokens=SPECIALS[1:],
        padding_side="left",
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
