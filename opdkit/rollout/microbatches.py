"""A step's rollout plumbing (`source.EngineRollouts`): the step's prompt micro-batches joined for one engine
call, each row's place in the step's global batch (what its sampling is keyed by), and the sampled step cut
back into micro-batches grouped by completion length.

    ids_BP, mask_BP = concat_prompts(batches, pad_token_id)       # one left-padded batch for the engine
    places = global_places(sizes, rank, world, batch_size)       # each row's place among all processes' rows
    order_B = length_order(rollout)                              # shortest completions first (stable)
    parts = split_rollout(rollout.rows(order_B), sizes)          # micro-batches, each trimmed to its rows
"""

from __future__ import annotations

import torch

from opdkit.rollout import sampling


def concat_prompts(batches: list[dict], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batches' left-padded prompts as one left-padded batch."""
    width = max(b["prompts"].shape[1] for b in batches)
    ids, masks = [], []
    for b in batches:
        extra = width - b["prompts"].shape[1]
        ids.append(torch.nn.functional.pad(b["prompts"], (extra, 0), value=pad_token_id))
        masks.append(torch.nn.functional.pad(b["prompt_attention_mask"], (extra, 0), value=0))
    return torch.cat(ids), torch.cat(masks)


def global_places(sizes: list[int], rank: int, world: int, batch_size: int) -> list[int]:
    """Each row's place in the optimizer step's global batch, from this process's micro-batches (`sizes`
    rows each, in the order the step took them): the position of its prompt in the step's slice of the
    data order, whatever the number of processes.

    accelerate shards the training data loader by batches (`BatchSamplerShard`; an iterable dataset's
    `IterableDatasetShard` and a dispatching loader slice the same way): of the sampler's batches of
    `batch_size` prompts, process `rank` of `world` takes every `world`-th, starting at its rank. So its
    k-th micro-batch of the step is the step's batch k x world + rank, and its row i sits at
    (k x world + rank) x batch_size + i. With G prompts a step, one process with G / b micro-batches and
    two with G / 2b each read the same batches of the data order: the same prompt at the same place."""
    return [(k * world + rank) * batch_size + i for k, n in enumerate(sizes) for i in range(n)]


def length_order(r: sampling.Rollout) -> torch.Tensor:
    """The rows by completion length, shortest first (a stable sort). Cut into micro-batches in this order
    (`split_rollout`), each micro-batch is trimmed to about its own rows' length, so the teacher's forward
    and the student's forward and backward skip most of the padding that the sampling order leaves (long
    completions are rare but set the width of every micro-batch they land in). It leaves the gradient
    alone: the step's loss is a sum over all its completion tokens divided by their count."""
    return torch.argsort(r.completion_mask_BC.sum(1), stable=True)


def split_rollout(r: sampling.Rollout, sizes: list[int]) -> list[sampling.Rollout]:
    """One rollout of the whole step cut back into micro-batches of `sizes` rows, each trimmed to its own
    widest prompt and longest completion (so a micro-batch looks as if it had been sampled alone)."""
    out, start = [], 0
    P = r.prompt_len
    for n in sizes:
        rows = slice(start, start + n)
        start += n
        mask_BP, comp_BC = r.attention_mask_BT[rows, :P], r.completion_mask_BC[rows]
        first = int(mask_BP.any(0).long().argmax()) if mask_BP.any() else P - 1
        width = max(1, int(comp_BC.sum(1).max()))
        cols = torch.cat([torch.arange(first, P), torch.arange(P, P + width)]).to(mask_BP.device)
        out.append(
            sampling.Rollout(
                input_ids_BT=r.input_ids_BT[rows][:, cols],
                attention_mask_BT=r.attention_mask_BT[rows][:, cols],
                completion_mask_BC=comp_BC[:, :width],
                prompt_len=P - first,
                logprobs_BC=None if r.logprobs_BC is None else r.logprobs_BC[rows, :width],
            )
        )
    return out
