"""Accuracy: batched greedy completions checked by a task (`opdkit.data.tasks`).

acc = accuracy(model, tok, *task.heldout(500), task.check, max_new_tokens=task.max_new_tokens)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opdkit.models import eos_ids
from opdkit.rollout import engines, sampling


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
    greedy = engines.SamplingSettings(
        max_new_tokens, 0.0, 1.0, eos_ids(tokenizer, model), tokenizer.pad_token_id
    )
    if engine is None:
        engine = engines.HFEngine()
    elif engine.name == "vllm":
        batch_size = max(1, len(messages))
    device = next(model.parameters()).device
    out: list[str] = []
    starts = range(0, len(messages), batch_size)
    for s in tqdm(starts, desc="evaluating", disable=not progress, leave=False):
        ids, mask = sampling.encode_prompts(
            tokenizer, list(messages[s : s + batch_size]), enable_thinking, device
        )
        out += sampling.decode_completions(tokenizer, engine.sample(model, ids, mask, greedy, seed=0))
    return out


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[list[dict]],
    answers: Sequence[str],
    check: Callable[[str, str], bool],
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    enable_thinking: bool = False,
) -> float:
    """Fraction of greedy completions that `check(completion, answer)` accepts."""
    if not messages:
        raise ValueError("accuracy() got no evaluation problems; pass at least one.")
    comps = greedy_completions(
        model,
        tokenizer,
        messages,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        enable_thinking=enable_thinking,
    )
    return sum(check(c, a) for c, a in zip(comps, answers)) / len(answers)


def task_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task,
    n: int = 500,
    batch_size: int = 256,
    **heldout,
) -> float:
    """Greedy accuracy on `n` of a task's built-in held-out problems (`opdkit.data.tasks.Task.heldout`)."""
    messages, answers = task.heldout(n, **heldout)
    return accuracy(
        model,
        tokenizer,
        messages,
        answers,
        task.check,
        max_new_tokens=task.max_new_tokens,
        batch_size=batch_size,
    )
