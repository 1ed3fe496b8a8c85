"""Prompts in, sampled completions out: the on-policy half of distillation.

Pitfalls this module exists for:
- prompts are left-padded, so a plain forward (positions 0..T-1) would shift every position of a
  padded row relative to `generate`; re-scoring uses `position_ids_from_mask`, as `generate` does;
- the completion ends at the first EOS *inclusive*; when pad == eos (Qwen's base models), the padding
  after it must not count, which is why the mask is built from the first EOS, not from `!= pad`;
- `generate` defaults to top_k=50 from the model's generation config; on-policy sampling must not
  silently truncate the student's distribution, so `top_k=0` is passed explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Rollout:
    """A batch of prompts with their sampled completions (B rows, P prompt + C completion columns)."""

    input_ids_BT: torch.Tensor  # prompt (left-padded) followed by completion (right-padded)
    attention_mask_BT: torch.Tensor  # 1 on real prompt tokens and on completion tokens up to EOS
    completion_mask_BC: torch.Tensor  # 1 on completion tokens up to and including the first EOS
    prompt_len: int  # P: columns that hold the (padded) prompt

    @property
    def completion_ids_BC(self) -> torch.Tensor:
        return self.input_ids_BT[:, self.prompt_len :]

    @property
    def position_ids_BT(self) -> torch.Tensor:
        return position_ids_from_mask(self.attention_mask_BT)

    def truncated_B(self, eos_token_id: int | list[int]) -> torch.Tensor:
        """True where the completion never produced an EOS."""
        return ~_is_eos(self.completion_ids_BC, eos_token_id).any(dim=1)


def _is_eos(ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    eos = torch.as_tensor(eos_token_id, device=ids.device).reshape(-1)
    return torch.isin(ids, eos)


def completion_mask(completion_ids_BC: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 on tokens up to and including the first EOS of each row, 0 after it (also when pad == eos)."""
    is_eos = _is_eos(completion_ids_BC, eos_token_id).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def position_ids_from_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions as `generate` assigns them under left padding: count of real tokens before, minus 1."""
    pos = attention_mask_BT.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[list[dict]],
    enable_thinking: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template each conversation with the generation prompt; left-pad into (ids, mask)."""
    ids = [
        list(
            tokenizer.apply_chat_template(
                m,
                tokenize=True,
                add_generation_prompt=True,
                enable_thinking=enable_thinking,
                return_dict=True,
            )["input_ids"]
        )
        for m in messages
    ]
    return left_pad(ids, tokenizer.pad_token_id, device)


def left_pad(
    ids: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in ids)
    out = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        if x:
            out[i, width - len(x) :] = torch.tensor(x)
            mask[i, width - len(x) :] = 1
    return out.to(device), mask.to(device)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    do_sample: bool = True,
    synced_gpus: bool = False,
    logits_processor=None,
) -> Rollout:
    """Sample completions with the model's KV cache (also when training uses gradient checkpointing).

    `synced_gpus=True` keeps every rank stepping until all ranks are done, so ranks whose
    completions end early do not leave a sharded (FSDP) model waiting in a collective.
    """
    was_training = model.training
    model.eval()
    kwargs = dict(do_sample=do_sample, max_new_tokens=max_new_tokens, use_cache=True)
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(
        input_ids=prompt_ids_BP,
        attention_mask=prompt_mask_BP,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        synced_gpus=synced_gpus,
        logits_processor=logits_processor,
        **kwargs,
    )
    model.train(was_training)
    prompt_len = prompt_ids_BP.shape[1]
    comp_mask = completion_mask(out[:, prompt_len:], eos_token_id)
    # Positions past the first EOS become padding, so pad == eos cannot leak into the completion.
    completion = torch.where(comp_mask.bool(), out[:, prompt_len:], pad_token_id)
    return Rollout(
        input_ids_BT=torch.cat([prompt_ids_BP, completion], dim=1),
        attention_mask_BT=torch.cat([prompt_mask_BP, comp_mask], dim=1),
        completion_mask_BC=comp_mask,
        prompt_len=prompt_len,
    )


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Completion text without special tokens (the final EOS is dropped)."""
    rows = [ids[m.bool()] for ids, m in zip(rollout.completion_ids_BC, rollout.completion_mask_BC)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)
