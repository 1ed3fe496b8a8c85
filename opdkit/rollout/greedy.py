"""Greedy decoding for evaluation: batched greedy completions, and the same completions with their final
answers forced (graded by a task: `opdkit.tasks.evaluate.accuracy`).

comps = greedy_completions(model, tok, messages, max_new_tokens=40)
forced = forced_completions(model, tok, messages, comps, task)

Forced answers, as the ADS reference reports forced accuracy beside raw accuracy: after each completion ends
or is cut, the task's answer cue is appended (`task.forced_prefix`: math's "**Final Answer**" and an open
`\\boxed{`; the tiny task's working before its answer, then `;`) and the model greedily writes up to
`task.forced_answer_tokens` more tokens; the whole text is graded by the task (its last answer counts). A
completion cut before its answer is then graded on the answer its writer gives when asked for one: raw
accuracy also measures whether a model finishes within the budget, forced accuracy less so. In thinking
mode a completion that never closed its thinking gets `</think>` first. Differences from the reference:
it grades the forced text as right when any of its pieces is; here the forced answer, the last one, is
graded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from opdkit.models import eos_ids
from opdkit.rollout import engines, sampling

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import

THINK_END = "</think>"


class ForcingTask(Protocol):
    """What forcing asks of a task (`opdkit.tasks.base.Task` answers it)."""

    forced_answer_tokens: int

    def check(self, completion: str, answer: str) -> bool: ...

    def forced_prefix(self, completion: str) -> str: ...


def _greedy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    engine: engines.HFEngine | engines.VLLMEngine | None,
    max_new_tokens: int,
    batch_size: int,
    n: int,
) -> tuple[engines.HFEngine | engines.VLLMEngine, engines.SamplingSettings, int]:
    """(engine, greedy settings stopping at the trainer's stop list, batch size): the kit's loop unless an
    engine is given; a vLLM engine takes all `n` prompts in one call, as it batches by itself."""
    greedy = engines.SamplingSettings(
        max_new_tokens, 0.0, 1.0, eos_ids(tokenizer, model), tokenizer.pad_token_id
    )
    if engine is None:
        return engines.HFEngine(), greedy, batch_size
    return engine, greedy, max(1, n) if engine.name == "vllm" else batch_size


@torch.no_grad()
def greedy_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[list[dict]],
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    enable_thinking: bool = False,
    progress: bool = False,
    engine: engines.HFEngine | engines.VLLMEngine | None = None,
) -> list[str]:
    """Greedy completions of `messages`, each ending at the first stop token: the tokenizer's EOS or one of
    the model's generation config (`models.eos_ids`), the trainer's list.

    By default the kit's loop decodes `model` in batches of `batch_size`. A vLLM `engine` decodes from the
    weights it was last synced with (sync `model` into it first) in one call, as it batches by itself."""
    engine, greedy, batch_size = _greedy(model, tokenizer, engine, max_new_tokens, batch_size, len(messages))
    device = next(model.parameters()).device
    out: list[str] = []
    starts = range(0, len(messages), batch_size)
    for s in tqdm(starts, desc="evaluating", disable=not progress, leave=False):
        ids, mask = sampling.encode_prompts(
            tokenizer, list(messages[s : s + batch_size]), enable_thinking, device
        )
        out += sampling.decode_completions(tokenizer, engine.sample(model, ids, mask, greedy, seed=0))
    return out


@torch.no_grad()
def forced_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[list[dict]],
    completions: Sequence[str],
    task: ForcingTask,
    *,
    batch_size: int = 256,
    enable_thinking: bool = False,
    progress: bool = False,
    engine: engines.HFEngine | engines.VLLMEngine | None = None,
) -> list[str]:
    """Each completion with its final answer forced: `task.forced_prefix(completion)` (after `</think>` in
    thinking mode when the completion never closed it), continued greedily for up to
    `task.forced_answer_tokens` tokens, returned whole (prefix and continuation)."""
    if len(messages) != len(completions):
        raise ValueError(f"{len(messages)} prompts but {len(completions)} completions; pass one per prompt.")
    prefixes = [
        task.forced_prefix(c + "\n" + THINK_END if enable_thinking and THINK_END not in c else c)
        for c in completions
    ]
    budget = task.forced_answer_tokens
    engine, greedy, batch_size = _greedy(model, tokenizer, engine, budget, batch_size, len(messages))
    device = next(model.parameters()).device
    out: list[str] = []
    starts = range(0, len(messages), batch_size)
    for s in tqdm(starts, desc="forcing answers", disable=not progress, leave=False):
        # The chat-templated prompt and the prefix's own tokens, as the completion followed the prompt.
        padded_BP, pad_mask_BP = sampling.encode_prompts(
            tokenizer, list(messages[s : s + batch_size]), enable_thinking
        )
        ids = [
            row[mask.bool()].tolist() + tokenizer.encode(prefix, add_special_tokens=False)
            for row, mask, prefix in zip(padded_BP, pad_mask_BP, prefixes[s : s + batch_size])
        ]
        ids_BP, mask_BP = sampling.left_pad(ids, tokenizer.pad_token_id, device)
        texts = sampling.decode_completions(tokenizer, engine.sample(model, ids_BP, mask_BP, greedy, seed=0))
        out += [p + t for p, t in zip(prefixes[s : s + batch_size], texts)]
    return out
