"""A byte-level BPE tokenizer for the tiny world: a teacher that cuts text differently from the student.

    tok = build_bpe_tokenizer()          # deterministic: trained on a fixed stream of tiny-task conversations

The tiny world's own tokenizer has one token per character; this one is byte-level BPE (GPT-2's byte
alphabet, so any text encodes, as Qwen's and DeepSeek's do) with merges learned from the task's text: digits
merge in pairs ("358" is "35" "8", "15" one token). With the same Qwen-style chat template and
special tokens as the character tokenizer, a teacher trained on it reads the same conversations in other
tokens, which is what distilling across tokenizers (`opdkit.opd.crosstok`) needs to be tried on a CPU.
"""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from opdkit.tiny import task
from opdkit.tiny.tokenizer import CHAT_TEMPLATE, IM_END, PAD, SPECIALS

VOCAB_SIZE = 400  # 256 bytes, 5 special tokens and the merges


def corpus(n: int = 4000, seed: int = 0) -> list[str]:
    """Text the merges are learned from: the role names and `n` prompts with one of their scratchpads."""
    rng = random.Random(seed)
    lines = ["system", "user", "assistant"]
    for _ in range(n):
        problem = task.sample_problem(rng)
        lines += [problem.prompt, task.scratchpad(problem, rng)]
    return lines


def build_bpe_tokenizer(vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus(), trainer=trainer)
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
