"""Accuracy: batched greedy exact match on the tiny task, boxed-answer extraction for math datasets."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from opdkit import rollout
from opdkit.tiny import task


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def normalize_math_answer(ans: str) -> str:
    """Light normalisation for exact match: no spaces, no ``$``, no trailing ``.0``; ``\\frac`` kept."""
    ans = ans.strip().strip("$").replace(" ", "").replace("\\!", "").rstrip(".")
    ans = re.sub(r"\\text\{(.*?)\}", r"\1", ans)
    ans = re.sub(r"^(-?\d+)\.0+$", r"\1", ans)
    return ans.replace("dfrac", "frac").replace("tfrac", "frac")


_ANSWER_LINE = re.compile(r"Answer:\s*(.+?)\s*$", re.MULTILINE)


def extract_math_answer(text: str) -> str | None:
    r"""The last ``\boxed{...}``, else the last ``Answer: ...`` line (the DAPO-Math-17k format)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    return lines[-1] if lines else None


def boxed_match(completion: str, ground_truth: str) -> bool:
    """Exact match after light normalisation of the boxed (or `Answer:`) answer."""
    got = extract_math_answer(completion)
    return got is not None and normalize_math_answer(got) == normalize_math_answer(str(ground_truth))


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
) -> list[str]:
    device = next(model.parameters()).device
    out: list[str] = []
    starts = range(0, len(messages), batch_size)
    for s in tqdm(starts, desc="evaluating", disable=not progress, leave=False):
        ids, mask = rollout.encode_prompts(
            tokenizer, list(messages[s : s + batch_size]), enable_thinking, device
        )
        r = rollout.sample(
            model,
            ids,
            mask,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        out += rollout.decode_completions(tokenizer, r)
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


def tiny_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    n: int = 500,
    seed: int = 1234,
    batch_size: int = 256,
) -> float:
    """Greedy exact-match accuracy on `n` held-out tiny-task problems."""
    probs = task.heldout_problems(n, seed)
    msgs = [[{"role": "user", "content": p.prompt}] for p in probs]
    return accuracy(
        model,
        tokenizer,
        msgs,
        [p.answer for p in probs],
        lambda c, a: task.extract_answer(c) == a,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
        batch_size=batch_size,
    )
