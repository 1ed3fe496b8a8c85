"""A character-level Hugging Face tokenizer with a Qwen-style chat template.

Built with `tokenizers` (a BPE model with no merges is a character model) and wrapped in
`PreTrainedTokenizerFast`, so it saves and loads through `AutoTokenizer` like any real one. Like
Qwen3 it has no BOS token, pads with ``<|endoftext|>`` and ends a turn with ``<|im_end|>``; the
assistant turn sits inside ``{% generation %}`` markers so `apply_chat_template(...,
return_assistant_tokens_mask=True)` finds the completion.
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


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
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
