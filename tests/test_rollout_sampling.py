"""Rollouts: completion masks, positions under left padding, sampling settings."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opdkit import tiny
from opdkit.rollout import sampling


def test_completion_mask_stops_after_first_eos_even_when_pad_is_eos():
    eos = 7
    ids = torch.tensor([[1, 2, 7, 7, 7], [1, 7, 3, 7, 7], [1, 2, 3, 4, 5]])
    assert sampling.completion_mask(ids, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert sampling.completion_mask(ids, [9, 7]).tolist()[1] == [1, 1, 0, 0, 0]


def test_position_ids_follow_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert sampling.position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def student_and_tok():
    tok = AutoTokenizer.from_pretrained(tiny.resolve("tiny:tokenizer"), padding_side="left")
    return AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")), tok


def test_rescoring_with_mask_positions_reproduces_generation_scores(student_and_tok):
    """Re-scoring a left-padded batch must see exactly the logits `generate` sampled from."""
    model, tok = student_and_tok
    msgs = [[{"role": "user", "content": "7+5"}], [{"role": "user", "content": "358+467"}]]
    ids, mask = sampling.encode_prompts(tok, msgs)
    assert mask[0, 0] == 0, "the shorter prompt is left-padded"
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    gen_logits = torch.stack(out.logits, dim=1)  # B x 6 x V
    full = out.sequences
    attn = torch.cat([mask, torch.ones_like(full[:, ids.shape[1] :])], dim=1)
    P = ids.shape[1]
    with torch.no_grad():
        good = model(
            input_ids=full, attention_mask=attn, position_ids=sampling.position_ids_from_mask(attn)
        ).logits
    torch.testing.assert_close(good[:, P - 1 : P + 5], gen_logits, atol=1e-4, rtol=1e-4)
    # (Qwen3's RoPE is relative, so a constant shift of a row's positions happens to be invisible;
    # models with absolute positions are not so forgiving, hence positions from the mask.)


def test_sample_masks_after_eos_and_reports_truncation(student_and_tok):
    model, tok = student_and_tok
    ids, mask = sampling.encode_prompts(tok, [[{"role": "user", "content": "123+456"}]] * 8)
    torch.manual_seed(0)
    r = sampling.sample(
        model, ids, mask, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=3
    )
    assert r.truncated_B(tok.eos_token_id).all(), "3 tokens cannot finish a scratchpad"
    r = sampling.sample(
        model, ids, mask, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=40
    )
    comp, cmask = r.completion_ids_BC, r.completion_mask_BC
    for row, m in zip(comp, cmask):
        n = int(m.sum())
        if n < comp.shape[1]:
            assert row[n - 1] == tok.eos_token_id and (row[n:] == tok.pad_token_id).all()
    assert (r.attention_mask_BT[:, ids.shape[1] :] == cmask).all()


def _mixed_prompts(tok, n=6):
    contents = ["7+5", "358+467", "12+990", "1+1", "999+999", "40+2"]
    return sampling.encode_prompts(tok, [[{"role": "user", "content": c}] for c in contents[:n]])


@pytest.mark.parametrize(
    "temperature,top_p,do_sample", [(1.0, 1.0, True), (0.7, 1.0, True), (1.3, 0.8, True), (1.0, 1.0, False)]
)
def test_sample_draws_the_tokens_generate_draws_without_top_k(student_and_tok, temperature, top_p, do_sample):
    """Same seed, same tokens as `generate(top_k=0)`: the loop samples exactly the policy's distribution."""
    model, tok = student_and_tok
    ids, mask = _mixed_prompts(tok)
    assert mask[:, 0].min() == 0, "some prompts are left-padded"
    settings = dict(temperature=temperature, top_p=top_p, top_k=0) if do_sample else {}
    torch.manual_seed(3)
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=30,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=do_sample,
        **settings,
    )
    torch.manual_seed(3)
    r = sampling.sample(
        model,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=30,
        temperature=temperature,
        top_p=top_p,
        do_sample=do_sample,
    )
    ref_comp = ref[:, ids.shape[1] :]
    ref_mask = sampling.completion_mask(ref_comp, tok.eos_token_id)
    assert r.completion_ids_BC.shape == ref_comp.shape
    assert torch.equal(r.completion_mask_BC, ref_mask)
    assert torch.equal(r.completion_ids_BC[ref_mask.bool()], ref_comp[ref_mask.bool()])


def test_checkpoint_generation_config_does_not_leak_into_sampling(student_and_tok):
    """A checkpoint's top_k / repetition penalty changes `generate`'s samples, never `sample`'s."""
    model, tok = student_and_tok
    ids, mask = _mixed_prompts(tok)
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=30)

    def both():
        torch.manual_seed(5)
        ours = sampling.sample(model, ids, mask, **kw).input_ids_BT
        torch.manual_seed(5)
        theirs = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, **kw
        )
        return ours, theirs

    plain_ours, plain_theirs = both()
    cfg = model.generation_config
    saved = (cfg.top_k, cfg.repetition_penalty)
    cfg.top_k, cfg.repetition_penalty = 3, 3.0
    try:
        ours, theirs = both()
    finally:
        cfg.top_k, cfg.repetition_penalty = saved
    assert torch.equal(ours, plain_ours)
    assert not torch.equal(theirs, plain_theirs), "generate does pick up the checkpoint's settings"


def test_generation_keeps_kv_cache_under_gradient_checkpointing(student_and_tok):
    """Checkpointing turns the cache off in training mode; sample() generates in eval mode, then restores."""
    model, tok = student_and_tok
    ids, mask = sampling.encode_prompts(tok, [[{"role": "user", "content": "123+456"}]] * 4)
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=12)
    torch.manual_seed(0)
    plain = sampling.sample(model, ids, mask, **kw).input_ids_BT
    model.activation_checkpointing_enable()
    model.train()
    seen = {}
    orig = model.forward

    def spy(*a, **k):
        seen.setdefault("training", model.training)
        seen.setdefault("cache", k.get("use_cache"))
        return orig(*a, **k)

    model.forward = spy
    try:
        torch.manual_seed(0)
        again = sampling.sample(model, ids, mask, **kw).input_ids_BT
    finally:
        del model.forward
        model.activation_checkpointing_disable()
    assert seen["training"] is False and seen["cache"] is True and model.training
    model.eval()
    assert torch.equal(plain, again)
