"""Completion-only supervised fine-tuning: the tiny world's recipe, and a baseline for distillation.

    batch = sft_batch(tokenizer, messages)            # chat-templated, labels -100 outside completions
    loss = model(**batch).loss                        # mean over completion tokens
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

IGNORE = -100


def completion_labels(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], enable_thinking: bool = False
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels are -100 outside the assistant's turns.

    The completion is found from the chat template's own `{% generation %}` markers when it has them,
    else from the prefix the template renders for the final assistant turn. No model-specific
    response marker is ever hard-coded.
    """
    enc = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        enable_thinking=enable_thinking,
    )
    ids = list(enc["input_ids"])
    mask = list(enc.get("assistant_masks") or [])
    if not any(mask):
        mask = _mask_from_prefix(tokenizer, messages, ids, enable_thinking)
    return ids, [t if m else IGNORE for t, m in zip(ids, mask)]


def _mask_from_prefix(tokenizer, messages, ids, enable_thinking) -> list[int]:
    """Mask for templates without generation markers: everything after the rendered prompt."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the last message must be the assistant's completion; got no assistant turn.")
    prompt = tokenizer.apply_chat_template(
        messages[:-1],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        enable_thinking=enable_thinking,
    )["input_ids"]
    n = len(prompt)
    if list(ids[:n]) != list(prompt):
        raise ValueError(
            "the chat template renders the prompt differently with and without the completion, so "
            "the completion cannot be located; use a template with {% generation %} markers."
        )
    # The template may append text after the assistant's end-of-turn token (e.g. a newline): the
    # completion ends at the last EOS or other special token. Not only the EOS: a base model's
    # tokenizer (Qwen2.5-3B: EOS <|endoftext|>) may use a chat template whose turns end with <|im_end|>.
    stops = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    end = len(ids)
    if any(t in stops for t in ids[n:]):
        end = n + max(i for i, t in enumerate(ids[n:]) if t in stops) + 1
    return [0] * n + [1] * (end - n) + [0] * (len(ids) - end)


def right_pad_batch(
    rows: list[tuple[list[int], list[int]]], pad_token_id: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(ids)] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attn.to(device), "labels": labels.to(device)}


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    enable_thinking: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    rows = [completion_labels(tokenizer, c, enable_thinking) for c in conversations]
    return right_pad_batch(rows, tokenizer.pad_token_id, device)


def train_sft(
    model: PreTrainedModel,
    next_batch: Callable[[int], dict[str, torch.Tensor]],
    steps: int,
    lr: float,
    *,
    warmup: int = 50,
    weight_decay: float = 0.0,
    evaluate: Callable[[int], float] | None = None,
    eval_every: int = 0,
    stop_when: Callable[[float], bool] | None = None,
    desc: str = "sft",
) -> list[dict]:
    """AdamW with linear warmup and cosine decay; returns the evaluation history.

    `next_batch(step)` builds the step's batch; every `eval_every` steps `evaluate(step)` is called
    and training stops early once `stop_when(value)` is true.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _warmup_cosine(s, warmup, steps))
    history: list[dict] = []
    model.train()
    bar = tqdm(range(steps), desc=desc)
    for step in bar:
        loss = model(**next_batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if evaluate and eval_every and (step + 1) % eval_every == 0:
            value = evaluate(step + 1)
            model.train()
            history.append({"step": step + 1, "loss": loss.item(), "eval": value})
            bar.set_postfix(loss=f"{loss.item():.3f}", eval=f"{value:.3f}")
            if stop_when and stop_when(value):
                break
    model.eval()
    return history


def _warmup_cosine(step: int, warmup: int, total: int) -> float:
    import math

    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
