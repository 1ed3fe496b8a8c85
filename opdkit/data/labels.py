"""Completion-only labels: a conversation's token ids with labels -100 outside the assistant's turns, padded
batches of them, and each row's summed completion-token loss (what SFT, a gradient of the completion loss and
a held-out NLL compute).

    ids, labels = completion_labels(tokenizer, messages)     # chat-templated, labels -100 outside completions
    batch = sft_batch(tokenizer, [messages, ...])            # right-padded input_ids, attention_mask, labels
    loss_sum_B, tokens_B = token_losses(model, batch)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

IGNORE = -100


def completion_labels(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    enable_thinking: bool = False,
    truncated: bool = False,
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels are -100 outside the assistant's turns. A `truncated`
    conversation (its writer ran out of tokens) keeps no end-of-turn target the template appends
    (`without_end_of_turn`): nothing teaches a learner to end a turn its writer never ended.

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
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    return without_end_of_turn(tokenizer, ids, labels) if truncated else (ids, labels)


def without_end_of_turn(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]
) -> tuple[list[int], list[int]]:
    """A truncated completion as the teacher wrote it: the end-of-turn tokens the chat template appends after
    the completion (Qwen's <|im_end|>, an EOS) are cut, with everything after them, so no loss target is a
    token the teacher never wrote. Unchanged when nothing is labelled."""
    stops = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    labelled = [k for k, t in enumerate(labels) if t != IGNORE]
    if not labelled:
        return ids, labels
    end = labelled[-1]
    while end >= labelled[0] and labels[end] in stops:
        end -= 1
    return ids[: end + 1], labels[: end + 1]


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


def make_batches(
    rows: Sequence[dict],
    indices: Sequence[int],
    batch_size: int,
    pad_token_id: int,
    device: torch.device | str,
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches of consecutive `indices` (sorted by length, so padding stays small)."""
    for s in range(0, len(indices), batch_size):
        ids = list(indices[s : s + batch_size])
        batch = right_pad_batch(
            [(rows[i]["input_ids"], rows[i]["labels"]) for i in ids], pad_token_id, device
        )
        yield {**batch, "trace_ids": torch.tensor(ids)}


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion-token loss per trace, completion tokens per trace), both of shape B.

    Per-token cross-entropy over shifted logits with `reduction="none"`: padded and prompt positions
    carry label -100 and contribute exactly zero, whatever the batch looks like.
    """
    logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t+1: shift the labels, not the logits, whose shifted copy would be the
    # largest tensor of the step at a 151k vocabulary. The last position predicts nothing (-100).
    labels_BT = shifted_labels(batch["labels"])
    loss_N = F.cross_entropy(
        logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return loss_N.view_as(labels_BT).sum(dim=1), (labels_BT != IGNORE).sum(dim=1)


def shifted_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (position t predicts token t+1); the last predicts nothing."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE)


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    enable_thinking: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    rows = [completion_labels(tokenizer, c, enable_thinking) for c in conversations]
    return right_pad_batch(rows, tokenizer.pad_token_id, device)
