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


def test_the_keyed_streams_are_splitmix64_bit_for_bit():
    """SplitMix64's published outputs for seed 1234567 (the reference C code's first two), from the int64
    tensor arithmetic and from the Python ints `engines.rollout_seeds` hashes with."""
    seed = 1234567
    want = [6457827717110365317, 3203168211198807973]
    states = torch.tensor([sampling.as_int64(seed + (n + 1) * sampling.GOLDEN) for n in range(2)])
    got = [x & (2**64 - 1) for x in sampling.mix64(states).tolist()]
    assert got == want
    assert [sampling.splitmix64(seed + (n + 1) * sampling.GOLDEN) for n in range(2)] == want
    u = sampling.keyed_uniform(torch.tensor([seed]), 0)
    assert u.dtype == torch.float64 and u.item() == ((want[0] >> 11) + 0.5) * 2.0**-53


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Upper 1e-4 quantiles of the chi-square distribution (degrees of freedom: critical value): a draw that
# follows the softmax fails one of these checks once in 10,000 seeds; the seeds here are fixed.
CHI2_1E4 = {2: 18.42, 5: 25.74}


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_keyed_draws_follow_the_softmax(top_p):
    """Over 40,000 rows (distinct seeds) and over 5,000 positions of one row, the drawn tokens' frequencies
    against softmax(logits) after top-p (transformers' warper): a chi-square test; a token top-p removes is
    never drawn."""
    logits_V = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    processed_1V = sampling.warpers(1.0, top_p)[0](None, logits_V[None]) if top_p < 1 else logits_V[None]
    probs_V = torch.softmax(processed_1V[0].double(), -1)
    n = 40_000
    across_rows = sampling.keyed_draw(processed_1V.expand(n, -1), torch.arange(n) * 7919 + 11, 0)
    seed_1 = torch.tensor([20260])
    along_a_row = torch.cat([sampling.keyed_draw(processed_1V, seed_1, i) for i in range(5000)])
    dof = int((probs_V > 0).sum()) - 1
    assert dof == (5 if top_p == 1.0 else 2)
    for drawn in (across_rows, along_a_row):
        counts = torch.bincount(drawn, minlength=6).double()
        assert counts[probs_V == 0].sum() == 0
        assert chi_square(counts, probs_V) < CHI2_1E4[dof]
    # The test has the power to see a distribution a little off: the same logits at temperature 1.1.
    hotter_V = torch.softmax(processed_1V[0].double() / 1.1, -1)
    assert chi_square(torch.bincount(across_rows, minlength=6).double(), hotter_V) > CHI2_1E4[dof]
    shifted = torch.cat([sampling.keyed_draw(processed_1V, seed_1, i + 1) for i in range(200)])
    assert (shifted[:-1] == along_a_row[1:200]).all() and not (shifted == along_a_row[:200]).all()


def test_keyed_sampling_does_not_depend_on_the_batch(student_and_tok):
    """Temperature 1, each row with its own seed: the whole batch, each row alone and the batch reversed draw
    the same completions; the global generator is left alone; other seeds draw other completions."""
    model, tok = student_and_tok
    msgs = [[{"role": "user", "content": f"{a}+{b}"}] for a, b in [(7, 5), (358, 467), (12, 99), (640, 3)]]
    ids_BP, mask_BP = sampling.encode_prompts(tok, msgs)
    seeds = [11, 12, 13, 14]

    def completions(rows: list[int], seeds_B: list[int]) -> list[list[int]]:
        sub_ids, sub_mask = ids_BP[rows], mask_BP[rows]
        width = int(sub_mask.sum(1).max())
        r = sampling.sample(
            model,
            sub_ids[:, -width:],
            sub_mask[:, -width:],
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=24,
            row_seeds_B=seeds_B,
        )
        return [ids[m.bool()].tolist() for ids, m in zip(r.completion_ids_BC, r.completion_mask_BC)]

    state = torch.get_rng_state()
    whole = completions([0, 1, 2, 3], seeds)
    assert torch.equal(torch.get_rng_state(), state)
    assert [completions([b], [seeds[b]])[0] for b in range(4)] == whole
    assert completions([3, 2, 1, 0], seeds[::-1]) == whole[::-1]
    assert completions([0, 1, 2, 3], [21, 22, 23, 24]) != whole
    assert len({tuple(c) for c in whole}) > 1


def test_greedy_decoding_ignores_row_seeds(student_and_tok):
    model, tok = student_and_tok
    ids_BP, mask_BP = sampling.encode_prompts(tok, [[{"role": "user", "content": "358+467"}]] * 2)
    kw = dict(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=12, do_sample=False
    )
    plain = sampling.sample(model, ids_BP, mask_BP, **kw)
    keyed = sampling.sample(model, ids_BP, mask_BP, row_seeds_B=[1, 2], **kw)
    assert torch.equal(plain.input_ids_BT, keyed.input_ids_BT)


def test_the_loops_own_logprobs_are_the_raw_log_softmax_of_a_full_forward(student_and_tok):
    """`keep_logprobs`: each sampled token's log-probability at temperature 1 over the whole head, before
    temperature and top-p shape the draw, as vLLM reports it; computed here by one full forward over the
    finished rows. Keeping them changes no token."""
    model, tok = student_and_tok
    ids, mask = _mixed_prompts(tok)
    settings = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=20)
    seeds = list(range(100, 106))
    kept = sampling.sample(
        model, ids, mask, temperature=0.7, top_p=0.9, row_seeds_B=seeds, keep_logprobs=True, **settings
    )
    plain = sampling.sample(model, ids, mask, temperature=0.7, top_p=0.9, row_seeds_B=seeds, **settings)
    assert torch.equal(kept.input_ids_BT, plain.input_ids_BT) and plain.logprobs_BC is None
    with torch.no_grad():
        logits_BTV = model(
            input_ids=kept.input_ids_BT,
            attention_mask=kept.attention_mask_BT,
            position_ids=kept.position_ids_BT,
        ).logits.double()
    P, C = kept.prompt_len, kept.completion_mask_BC.shape[1]
    logp_BCV = torch.log_softmax(logits_BTV[:, P - 1 : P - 1 + C], dim=-1)
    want_BC = logp_BCV.gather(-1, kept.completion_ids_BC[:, :, None])[:, :, 0] * kept.completion_mask_BC
    assert kept.completion_mask_BC.sum() > 20
    torch.testing.assert_close(kept.logprobs_BC.double(), want_BC, rtol=0, atol=1e-4)


def test_turns_keep_the_cache_and_draw_what_a_whole_re_read_draws(student_and_tok):
    """`Turns`: three calls on growing transcripts (each extended by its completion and "tool" tokens of
    different lengths, one by none; rows leaving between calls) draw the tokens `sample` draws on the whole
    transcripts left-padded, with the same masks, and log-probabilities within the float32 floor (the first
    call's exactly: the same forwards); a transcript that does not extend the cached one, or rows that were
    not in the previous call, are refused."""
    model, tok = student_and_tok
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=0.7, top_p=0.9)
    turns = sampling.Turns(model, keep_logprobs=True, **kw)
    ids, mask = _mixed_prompts(tok, n=4)
    transcripts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    rows = [0, 1, 2, 3]
    tools = tok("<tool_response>17</tool_response>", add_special_tokens=False)["input_ids"]
    for call, max_new in enumerate((40, 9, 12)):
        seeds = [100 * call + r for r in rows]
        got = turns.sample(rows, transcripts, max_new, seeds)
        want = sampling.sample(
            model, *sampling.left_pad(transcripts, tok.pad_token_id), max_new_tokens=max_new,
            row_seeds_B=seeds, keep_logprobs=True, **kw,
        )  # fmt: skip
        for name in ("input_ids_BT", "attention_mask_BT", "completion_mask_BC"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (call, name)
        atol = 0 if call == 0 else 1e-5
        torch.testing.assert_close(got.logprobs_BC, want.logprobs_BC, rtol=0, atol=atol)
        done = [ids[m.bool()].tolist() for ids, m in zip(got.completion_ids_BC, got.completion_mask_BC)]
        if call == 0:  # the shortest completion was fed whole: with no tool tokens, nothing is new
            assert min(len(d) for d in done) < got.completion_mask_BC.shape[1]
        extra = {k: tools[: (5 * k) % len(tools)] for k in range(len(rows))}
        extra[min(range(len(rows)), key=lambda k: len(done[k]))] = []
        transcripts = [t + d + extra[k] for k, (t, d) in enumerate(zip(transcripts, done))]
        keep = [k for k in range(len(rows)) if k != 1]  # the second row's episode ends
        rows, transcripts = [rows[k] for k in keep], [transcripts[k] for k in keep]
    with pytest.raises(ValueError, match="does not extend"):
        turns.sample(rows, [t[:-2] for t in transcripts], 4, [1] * len(rows))
    with pytest.raises(ValueError, match="previous call"):
        turns.sample([7], transcripts[:1], 4, [1])
