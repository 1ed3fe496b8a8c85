"""ADS sampling (opdkit.ads.sampler): λ = 0 as plain sampling token for token, the ADS term before
temperature, top-k and top-p (the reference's order), one processor per batch, the empty chain of plain greedy
decoding, and coupled sampling (ADS and plain drawn with the same noise) at λ = 0."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_prompts
from transformers import LogitsProcessorList

from opdkit.ads import sampler
from opdkit.ads.direction import FiniteDifference
from opdkit.ads.sampler import ADSLogitsProcessor, ads_processors, ads_sample
from opdkit.rollout import sampling
from opdkit.tasks import tiny as task


def test_lambda_zero_is_plain_sampling_token_for_token(teacher, proxy, g, tok):
    ids, mask = tiny_prompts(tok)
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=40)
    torch.manual_seed(7)
    plain = sampling.sample(teacher, ids, mask, temperature=1.3, top_p=0.9, **kwargs)
    torch.manual_seed(7)
    zero = ads_sample(
        teacher,
        ids,
        mask,
        direction=FiniteDifference(proxy, g),
        lam=0.0,
        temperature=1.3,
        top_p=0.9,
        **kwargs,
    )
    assert torch.equal(plain.input_ids_BT, zero.input_ids_BT)
    torch.manual_seed(7)
    steered = ads_sample(
        teacher,
        ids,
        mask,
        direction=FiniteDifference(proxy, g),
        lam=0.3,
        temperature=1.3,
        top_p=0.9,
        **kwargs,
    )
    assert not torch.equal(plain.input_ids_BT, steered.input_ids_BT)


def test_the_ads_term_comes_before_temperature_and_top_p(proxy, g, tok):
    """The processor chain gives top_p((z + λΔ) / τ), the reference's order."""
    ids, mask = tiny_prompts(tok, 3)
    direction = FiniteDifference(proxy, g)
    delta = FiniteDifference(proxy, g).start(ids, mask)
    scores = torch.randn(3, delta.shape[-1]) * 3
    got = ads_processors(direction, 0.2, mask, temperature=0.7, top_p=0.8)(ids, scores)
    want = (scores + 0.2 * delta) / 0.7
    keep = torch.isfinite(got)
    assert keep.any(dim=1).all() and (~keep).any()  # top-p cut something, kept something
    torch.testing.assert_close(got[keep], want[keep])
    sorted_p = want.softmax(-1).sort(dim=-1, descending=True)
    # what was kept is the smallest prefix of the sorted distribution reaching 0.8
    for b in range(3):
        n = int(keep[b].sum())
        assert sorted_p.values[b, : n - 1].sum() < 0.8 <= sorted_p.values[b, :n].sum() + 1e-6


def test_top_k_comes_after_the_ads_term_and_temperature_before_top_p(proxy, g, tok):
    ids, mask = sampling.encode_prompts(tok, [[{"role": "user", "content": "12+34="}]] * 3)
    delta = FiniteDifference(proxy, g).start(ids, mask)
    torch.manual_seed(0)
    scores = torch.randn(3, delta.shape[-1]) * 3
    got = ads_processors(FiniteDifference(proxy, g), 0.2, mask, temperature=0.7, top_p=0.8, top_k=5)(
        ids, scores
    )
    want = (scores + 0.2 * delta) / 0.7
    keep = torch.isfinite(got)
    torch.testing.assert_close(got[keep], want[keep])
    for b in range(3):
        top5 = set(want[b].topk(5).indices.tolist())
        kept = set(keep[b].nonzero().flatten().tolist())
        assert kept <= top5 and kept  # top-k first: nothing outside the 5 best of z + λΔ over τ
        p = want[b, sorted(top5)].softmax(-1).sort(descending=True).values  # renormalised over the top 5
        n = len(kept)
        assert p[: n - 1].sum() < 0.8 <= p[:n].sum() + 1e-6  # then the nucleus of what top-k left


def test_top_k_zero_is_off_and_warpers_keep_generate_order():
    names = [type(w).__name__ for w in sampling.warpers(0.7, 0.9, 50)]
    assert names == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert [type(w).__name__ for w in sampling.warpers(0.7, 0.9)] == [
        "TemperatureLogitsWarper",
        "TopPLogitsWarper",
    ]


def test_processor_refuses_a_second_batch(proxy, g, tok):
    ids, mask = tiny_prompts(tok, 2)
    proc = ADSLogitsProcessor(FiniteDifference(proxy, g), 0.1, mask)
    proc(ids, torch.zeros(2, len(tok)))
    with pytest.raises(RuntimeError, match="new processor for each batch"):
        proc(torch.cat([ids, ids[:, :3]], dim=1), torch.zeros(2, len(tok)))


def test_processor_chain_is_empty_for_plain_greedy():
    assert len(ads_processors(None, 0.0, torch.ones(1, 3), temperature=0.0, top_p=0.5)) == 0
    assert isinstance(ads_processors(None, 0.0, torch.ones(1, 3), 1.0, 1.0), LogitsProcessorList)
    with pytest.raises(ValueError, match="needs a direction"):
        ads_processors(None, 0.1, torch.ones(1, 3), 1.0, 1.0)


def test_coupled_sampling_at_lambda_zero_is_a_sample_of_the_teacher(teacher, tok):
    """Gumbel-max with shared noise: at λ 0 both draws agree, and the trace is a valid completion."""
    ids = sampling.encode_prompts(tok, [[{"role": "user", "content": "123+456"}]])[0][0].tolist()
    steps = sampler.coupled_sample(
        teacher,
        None,
        ids,
        lam=0.0,
        temperature=1.0,
        top_p=1.0,
        eos_token_id=tok.eos_token_id,
        max_new_tokens=40,
        seed=0,
    )
    assert all(s["token"] == s["plain_token"] for s in steps)
    assert steps[-1]["token"] == tok.eos_token_id
    assert task.extract_answer(tok.decode([s["token"] for s in steps], skip_special_tokens=True)) is not None


def test_sample_traces_keeps_the_prompts_order_and_says_which_were_cut(teacher, tok):
    """Prompts of different lengths, batched by length: each answer is its own prompt's (greedy, the same as
    that prompt sampled alone), and a completion stopped by max_new_tokens is marked truncated."""
    probs = [task.problems(1, 20 + i, n_digits=3 - i % 3)[0] for i in range(5)]  # lengths not in order
    messages = [[{"role": "user", "content": p.prompt}] for p in probs]
    kwargs = dict(direction=None, lam=0.0, temperature=0.0, seed=0, max_new_tokens=40)
    batched = sampler.sample_traces(teacher, tok, messages, batch_size=2, **kwargs)
    alone = [sampler.sample_traces(teacher, tok, [m], batch_size=1, **kwargs)[0] for m in messages]
    assert batched == alone
    assert not any(cut for _, cut in batched)
    assert len({text for text, _ in batched}) == 5  # five different answers: the order is seen
    short = sampler.sample_traces(teacher, tok, messages, batch_size=2, **{**kwargs, "max_new_tokens": 3})
    assert all(cut for _, cut in short)
    assert all(text.startswith(cut) for (text, _), (cut, _) in zip(batched, short))
