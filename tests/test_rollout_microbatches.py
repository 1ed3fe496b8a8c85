"""opdkit.rollout.microbatches, the rollout source's plumbing: one engine call for the step's micro-batches,
cut back into micro-batches that look as if each had been sampled alone, and grouped by completion length with
the same rows and less padding; each row's place in the step's global batch, against accelerate's sharding."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, micro_batches
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.models import load_tokenizer
from opdkit.rollout import microbatches, sampling


@pytest.fixture(scope="module")
def student_tok():
    return AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")), load_tokenizer("tiny:student")


def test_concat_prompts_left_pads_every_micro_batch_to_the_widest(student_tok):
    _, tok = student_tok
    batches = micro_batches(tok)
    ids_BP, mask_BP = microbatches.concat_prompts(batches, tok.pad_token_id)
    widest = max(b["prompts"].shape[1] for b in batches)
    assert ids_BP.shape == mask_BP.shape == (6, widest)
    rows = [(ids, m) for b in batches for ids, m in zip(b["prompts"], b["prompt_attention_mask"])]
    for k, (ids, m) in enumerate(rows):
        assert ids_BP[k][mask_BP[k].bool()].tolist() == ids[m.bool()].tolist()  # the same prompt tokens
        assert mask_BP[k, -1] == 1 and int(mask_BP[k].sum()) == int(m.sum())  # at the right end
        assert (ids_BP[k][~mask_BP[k].bool()] == tok.pad_token_id).all()


def test_one_call_for_the_step_gives_each_micro_batch_its_own_layout(student_tok):
    """Greedy, so the rows do not depend on batching: the split step equals micro-batches sampled alone."""
    model, tok = student_tok
    batches = micro_batches(tok)
    ids, mask = microbatches.concat_prompts(batches, tok.pad_token_id)
    whole = hf_greedy(model, tok, ids, mask)
    parts = microbatches.split_rollout(whole, [b["prompts"].shape[0] for b in batches])
    for b, part in zip(batches, parts):
        alone = hf_greedy(model, tok, b["prompts"], b["prompt_attention_mask"])
        assert part.prompt_len == alone.prompt_len
        torch.testing.assert_close(part.input_ids_BT, alone.input_ids_BT)
        torch.testing.assert_close(part.attention_mask_BT, alone.attention_mask_BT)
        torch.testing.assert_close(part.completion_mask_BC, alone.completion_mask_BC)


def test_micro_batches_grouped_by_length_hold_the_same_rows_with_less_padding():
    """`length_order` then `split_rollout`: every row once, unchanged; micro-batch widths follow the rows'
    lengths; the trimmed micro-batches hold fewer columns than in sampling order."""
    gen = torch.Generator().manual_seed(0)
    B, P, C = 24, 5, 40
    lengths_B = torch.randint(1, C + 1, (B,), generator=gen)
    comp_BC = (torch.arange(C)[None] < lengths_B[:, None]).long()
    prompt_mask_BP = (torch.arange(P)[None] >= torch.randint(0, P, (B,), generator=gen)[:, None]).long()
    ids_BT = torch.randint(3, 100, (B, P + C), generator=gen) * torch.cat([prompt_mask_BP, comp_BC], 1)
    whole = sampling.Rollout(
        ids_BT, torch.cat([prompt_mask_BP, comp_BC], 1), comp_BC, P, torch.rand(B, C, generator=gen) * comp_BC
    )
    sizes = [8, 8, 8]
    order = microbatches.length_order(whole)
    grouped = microbatches.split_rollout(whole.rows(order), sizes)
    plain = microbatches.split_rollout(whole, sizes)
    assert sorted(order.tolist()) == list(range(B))
    widths = [g.completion_mask_BC.shape[1] for g in grouped]
    assert widths == sorted(widths) and widths[-1] == int(lengths_B.max())
    for g, first in zip(grouped, (0, 8, 16)):
        assert int(g.completion_mask_BC.sum(1).max()) == g.completion_mask_BC.shape[1]
        for b in range(g.input_ids_BT.shape[0]):  # each row is its original row, padding trimmed
            src = int(order[first + b])
            real = g.attention_mask_BT[b].bool()
            assert (
                g.input_ids_BT[b][real].tolist()
                == whole.input_ids_BT[src][whole.attention_mask_BT[src].bool()].tolist()
            )
            n = int(lengths_B[src])
            torch.testing.assert_close(g.logprobs_BC[b, :n], whole.logprobs_BC[src, :n])
    area = sum(g.input_ids_BT.numel() for g in grouped)
    assert area < sum(r.input_ids_BT.numel() for r in plain)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(64))


@pytest.mark.parametrize("iterable", [False, True])
def test_each_row_s_global_place_is_its_prompt_s_place_in_the_step_whatever_the_process_count(iterable):
    """accelerate's own sharding of a shuffled data loader (`prepare_data_loader`: `BatchSamplerShard`, or an
    iterable dataset's `IterableDatasetShard`), 16 prompts a step in micro-batches of 2 on 1, 2 and 4
    processes (8, 4 and 2 micro-batches each): `global_places` puts every prompt at the same place of the
    same step, no two at one place."""
    from accelerate.data_loader import prepare_data_loader

    steps, batch = 4, 2
    found = {}
    for world in (1, 2, 4):
        accumulate = 16 // (batch * world)
        at: dict[tuple[int, int], int] = {}
        for rank in range(world):
            if iterable:
                loader = DataLoader(Stream(), batch_size=batch)
            else:
                shuffled = RandomSampler(range(64), generator=torch.Generator().manual_seed(7))
                loader = DataLoader(list(range(64)), batch_size=batch, sampler=shuffled)
            loader = prepare_data_loader(
                loader,
                device=torch.device("cpu"),
                num_processes=world,
                process_index=rank,
                put_on_device=False,
                dispatch_batches=False,
                use_seedable_sampler=True,
                data_seed=5,
            )
            micro = [b.tolist() for b in loader]
            assert len(micro) == steps * accumulate
            for s in range(steps):
                taken = micro[s * accumulate : (s + 1) * accumulate]
                places = microbatches.global_places([len(b) for b in taken], rank, world, batch)
                for place, prompt in zip(places, [p for b in taken for p in b], strict=True):
                    assert (s, place) not in at
                    at[s, place] = prompt
        assert len(at) == 64 and sorted(at.values()) == list(range(64))
        found[world] = at
    assert found[1] == found[2] == found[4]
    if iterable:
        assert found[1] == {(s, p): 16 * s + p for s in range(steps) for p in range(16)}
