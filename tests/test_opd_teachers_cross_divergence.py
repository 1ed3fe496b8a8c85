"""Tests for opdkit.opd.teachers.cross.divergence: the loss and its gradient against TRL's `ULDLoss` (GOLD) in
float64 and against a brute-force chain rule; the closed-form backward (`_StudentLoss`) against plain
autograd."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import CROSSTOK_PROMPTS as PROMPTS
from helpers import CROSSTOK_TEXTS as TEXTS
from helpers import sorted_l1_reference

from opdkit.config import ConfigError
from opdkit.opd.teachers.cross import (
    CrossTokenizerSettings,
    Tokens,
    VocabMatch,
    align,
    align_ends,
    cross_tokenizer_divergence,
    divergence,
    prediction_positions,
)


@pytest.fixture(scope="module")
def uld_loss_class():
    gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
    return gold.ULDLoss


@pytest.fixture(scope="module")
def batch(qwen3_bytes, deepseek_bytes):
    """Qwen3 student and DeepSeek teacher tokenizations of the same completions, random float64 hidden states
    and heads (vocabularies at the tokenizers' sizes), and the full logits TRL reads."""
    (q, qb), (d, db) = qwen3_bytes, deepseek_bytes
    gen = torch.Generator().manual_seed(0)
    rows = []
    for prompt, text in zip(PROMPTS, TEXTS):
        s_ids = [*q(text, add_special_tokens=False).input_ids, q.eos_token_id]
        t = db.tokenize(d, qb.text(s_ids), d.eos_token_id)
        rows.append(
            dict(
                s_prompt=q(prompt, add_special_tokens=False).input_ids,
                t_prompt=d(prompt, add_special_tokens=False).input_ids,
                s=Tokens(s_ids, qb.ends(s_ids)),
                t=t,
            )
        )
    s_len = max(len(r["s_prompt"]) + len(r["s"].ids) for r in rows)
    t_len = max(len(r["t_prompt"]) + len(r["t"].ids) for r in rows)
    s_hidden = torch.randn(len(rows), s_len, 8, generator=gen, dtype=torch.float64)
    t_hidden = torch.randn(len(rows), t_len, 6, generator=gen, dtype=torch.float64)
    s_head = 2.0 * torch.randn(len(q), 8, generator=gen, dtype=torch.float64)
    t_head = 2.0 * torch.randn(len(d), 6, generator=gen, dtype=torch.float64)
    return SimpleNamespace(
        rows=rows, q=q, d=d, s_hidden=s_hidden, t_hidden=t_hidden, s_head=s_head, t_head=t_head,
        match=VocabMatch.of(q, d),
    )  # fmt: skip


def _trl_inputs(batch, side: str):
    """(input_ids, labels, byte offsets) padded on the right, as GOLD's collators make them."""
    length = (batch.s_hidden if side == "s" else batch.t_hidden).shape[1]
    ids = torch.zeros(len(batch.rows), length, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    offsets = torch.zeros(len(batch.rows), length, 2, dtype=torch.long)
    for b, r in enumerate(batch.rows):
        prompt, tokens = r[f"{side}_prompt"], r[side]
        p, c = len(prompt), len(tokens.ids)
        ids[b, : p + c] = torch.tensor(prompt + tokens.ids)
        labels[b, p : p + c] = torch.tensor(tokens.ids)
        offsets[b, p : p + c, 1] = torch.tensor(tokens.byte_ends) // 2
    return ids, labels, offsets


def _settings(merge, hybrid, weights, skip_eos, temps) -> CrossTokenizerSettings:
    return CrossTokenizerSettings(
        crosstok_merge=merge,
        crosstok_hybrid=hybrid,
        crosstok_hybrid_weights=weights,
        crosstok_matched_weight=0.7,
        crosstok_unmatched_weight=0.4,
        crosstok_student_temperature=temps[0],
        crosstok_teacher_temperature=temps[1],
        crosstok_skip_student_eos=skip_eos,
        crosstok_skip_teacher_eos=skip_eos,
    )


def _ours(batch, settings, beta, head=True):
    """The loss with TRL's reduction, and the gradients of the student's hidden states and head."""
    s_hidden, s_head = batch.s_hidden.clone().requires_grad_(), batch.s_head.clone().requires_grad_()
    s_rows, t_rows = [], []
    for b, r in enumerate(batch.rows):
        s_rows += [
            s_hidden[b, k] for k in prediction_positions(len(r["s_prompt"]), len(r["s"].ids), settings)
        ]
        t_rows += [
            batch.t_hidden[b, k] for k in prediction_positions(len(r["t_prompt"]), len(r["t"].ids), settings)
        ]
    plan = align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )
    s_NH, t_MH = torch.stack(s_rows), torch.stack(t_rows)
    if head:
        args = (s_NH, s_head, t_MH, batch.t_head)
    else:  # logits rows
        args = (s_NH @ s_head.T, None, t_MH @ batch.t_head.T, None)
    out = cross_tokenizer_divergence(
        *args,
        plan,
        settings,
        match=batch.match,
        beta=beta,
        group_weights_G=plan.row_mean_weights(),
        chunk_size=5,
    )
    out.sum.backward()
    return out.sum.detach(), s_hidden.grad, s_head.grad, out


def _trl(batch, uld_loss_class, merge, hybrid, weights, skip_eos, temps, beta):
    config = SimpleNamespace(
        uld_crossentropy_weight=0.0,
        uld_distillation_weight=1.0,
        uld_student_temperature=temps[0],
        uld_teacher_temperature=temps[1],
        uld_skip_student_eos=skip_eos,
        uld_skip_teacher_eos=skip_eos,
        use_extended_uld=True,
        uld_token_merge_strategy=merge,
        uld_use_hybrid_loss=hybrid,
        uld_hybrid_matched_weight=0.7 if weights == "fixed" else None,
        uld_hybrid_unmatched_weight=0.4 if weights == "fixed" else None,
        beta=beta,
    )
    loss_fn = uld_loss_class(config, student_tokenizer=batch.q, teacher_tokenizer=batch.d)
    s_hidden, s_head = batch.s_hidden.clone().requires_grad_(), batch.s_head.clone().requires_grad_()
    s_ids, s_labels, s_off = _trl_inputs(batch, "s")
    t_ids, t_labels, t_off = _trl_inputs(batch, "t")
    loss = loss_fn(
        s_hidden @ s_head.T,
        batch.t_hidden @ batch.t_head.T,
        s_labels,
        t_labels,
        s_ids,
        t_ids,
        student_byte_offsets=s_off,
        teacher_byte_offsets=t_off,
    )
    loss.backward()
    return loss.detach(), s_hidden.grad, s_head.grad


CASES = [  # (TRL's merge, hybrid, weights, skip EOS, (student, teacher) temperatures, beta)
    ("observed", False, "adaptive", True, (1.0, 1.0), 0.5),
    ("bayesian", False, "adaptive", True, (1.0, 1.0), 0.5),
    ("bayesian", False, "adaptive", False, (0.7, 1.3), 0.5),
    ("observed", True, "adaptive", True, (1.0, 1.0), 0.5),
    ("bayesian", True, "adaptive", True, (1.3, 0.8), 0.5),
    ("bayesian", True, "fixed", False, (1.0, 1.0), 0.0),
    ("observed", True, "fixed", True, (0.9, 1.0), 1.0),
    ("bayesian", True, "fixed", True, (1.0, 1.0), 1.0),
]


@pytest.mark.parametrize(("merge", "hybrid", "weights", "skip_eos", "temps", "beta"), CASES)
def test_matches_trl_uld_loss(batch, uld_loss_class, merge, hybrid, weights, skip_eos, temps, beta):
    """Loss and gradients (student hidden states and head) to 1e-6 relative in float64; TRL's "observed" is
    our "observed-trl"."""
    ours_merge = "observed-trl" if merge == "observed" else merge
    settings = _settings(ours_merge, hybrid, weights, skip_eos, temps)
    loss, grad_h, grad_w, out = _ours(batch, settings, beta)
    ref_loss, ref_h, ref_w = _trl(batch, uld_loss_class, merge, hybrid, weights, skip_eos, temps, beta)
    assert loss.item() > 0.01
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-6, atol=1e-12)
    if hybrid:
        assert out.matched_G.abs().sum() > 0 and out.unmatched_G.sum() > 0  # unnormalised: JSD may be < 0


def test_logit_rows_give_the_same_loss(batch):
    settings = _settings("bayesian", True, "adaptive", True, (1.0, 1.0))
    loss, grad_h, grad_w, _ = _ours(batch, settings, 0.5)
    loss_l, grad_h_l, grad_w_l, _ = _ours(batch, settings, 0.5, head=False)
    torch.testing.assert_close(loss_l, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_h_l, grad_h)
    torch.testing.assert_close(grad_w_l, grad_w)


def _chain_rule_reference(batch, merge: str) -> torch.Tensor:
    """Loops over rows and groups, the chain rule by hand from full logits at the predicting positions
    (P-1+k for token k), and ULD's sorted L1 by plain sorting; TRL's reduction."""
    s_logits = torch.log_softmax(batch.s_hidden @ batch.s_head.T, -1)
    t_logits = torch.log_softmax(batch.t_hidden @ batch.t_head.T, -1)
    per_row = []
    for b, r in enumerate(batch.rows):
        s, t = r["s"], r["t"]
        groups = [g for g in align_ends(s.byte_ends[:-1], t.byte_ends[:-1]) if g[0] and g[1]]
        losses = []
        for s_idx, t_idx in groups:
            merged = []
            for idx, logp, prompt, ids in (
                (s_idx, s_logits, r["s_prompt"], s.ids),
                (t_idx, t_logits, r["t_prompt"], t.ids),
            ):
                rows = [logp[b, len(prompt) - 1 + k] for k in idx]
                base = rows[-1] if merge == "bayesian" else rows[0]
                others = idx[:-1] if merge == "bayesian" else idx[1:]
                scale = sum(rows[idx.index(k)][ids[k]] for k in others) if others else 0.0
                merged.append((base + scale).exp())
            losses.append(sorted_l1_reference(merged[0][None], merged[1][None])[0])
        per_row.append(torch.stack(losses).mean())
    return torch.stack(per_row).mean()


@pytest.mark.parametrize("merge", ["observed", "bayesian"])
def test_the_chain_rule_by_hand(batch, merge):
    settings = _settings(merge, False, "adaptive", True, (1.0, 1.0))
    loss, *_ = _ours(batch, settings, 0.5)
    # GOLD floors a merged token's probability at 1e-8 (EPS); the chain rule by hand does not.
    torch.testing.assert_close(loss, _chain_rule_reference(batch, merge), rtol=1e-6, atol=0)


def test_trl_observed_reads_the_next_row(batch):
    """TRL's "observed" is not the chain rule: it differs from ours on this batch (multi-token groups), while
    "observed-trl" is TRL's (test_matches_trl_uld_loss)."""
    right, *_ = _ours(batch, _settings("observed", False, "adaptive", True, (1.0, 1.0)), 0.5)
    trl_like, *_ = _ours(batch, _settings("observed-trl", False, "adaptive", True, (1.0, 1.0)), 0.5)
    assert abs(right.item() - trl_like.item()) > 1e-3 * right.item()
    assert list(prediction_positions(5, 3, _settings("observed", False, "adaptive", True, (1, 1)))) == [
        4,
        5,
        6,
    ]
    assert list(prediction_positions(5, 3, _settings("observed-trl", False, "adaptive", True, (1, 1)))) == [
        5,
        6,
        7,
    ]


def test_positional_alignment_pairs_by_index(batch):
    settings = CrossTokenizerSettings(crosstok_align="positional")
    plan = align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )
    expected = sum(min(len(r["s"].ids), len(r["t"].ids)) - 1 for r in batch.rows)
    assert plan.num_groups == expected and len(plan.s_scalar_Q) == len(plan.t_scalar_Q) == 0


def test_group_chunks_and_errors(batch):
    settings = _settings("bayesian", False, "adaptive", True, (1.0, 1.0))
    plan = align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )
    s_NH = torch.randn(plan.num_student_tokens, 8, dtype=torch.float64)
    t_MH = torch.randn(plan.num_teacher_tokens, 6, dtype=torch.float64)
    sums = {
        c: cross_tokenizer_divergence(
            s_NH, batch.s_head, t_MH, batch.t_head, plan, settings, chunk_size=c
        ).sum
        for c in (1, 7, 1000)
    }
    torch.testing.assert_close(sums[1], sums[1000])
    torch.testing.assert_close(sums[7], sums[1000])
    with pytest.raises(ValueError, match="one row per completion token"):
        cross_tokenizer_divergence(s_NH[1:], batch.s_head, t_MH, batch.t_head, plan, settings)
    with pytest.raises(ValueError, match="VocabMatch"):
        cross_tokenizer_divergence(
            s_NH,
            batch.s_head,
            t_MH,
            batch.t_head,
            plan,
            _settings("bayesian", True, "adaptive", True, (1, 1)),
        )
    with pytest.raises(ConfigError, match="crosstok_merge"):
        align([], [], CrossTokenizerSettings(crosstok_merge="first"))


def test_identical_tokenizers_and_models_give_zero(qwen3_bytes):
    q, qb = qwen3_bytes
    ids = [*q(TEXTS[0], add_special_tokens=False).input_ids, q.eos_token_id]
    tokens = Tokens(ids, qb.ends(ids))
    settings = CrossTokenizerSettings()
    plan = align([tokens], [tokens], settings, student_eos=q.eos_token_id, teacher_eos=q.eos_token_id)
    assert plan.num_groups == len(ids) - 1 and len(plan.s_scalar_Q) == 0
    logits_NV = torch.randn(len(ids), 1000, dtype=torch.float64)
    out = cross_tokenizer_divergence(logits_NV, None, logits_NV.clone(), None, plan, settings)
    assert out.sum.item() == pytest.approx(0.0, abs=1e-12)


def _plan(batch, settings):
    return align(
        [r["s"] for r in batch.rows],
        [r["t"] for r in batch.rows],
        settings,
        student_eos=batch.q.eos_token_id,
        teacher_eos=batch.d.eos_token_id,
    )


def _direct(s_logits_NV, t_logits_MW, plan, settings) -> torch.Tensor:
    """Each group's ULD loss by plain autograd: log-softmax at the temperature, the chain rule's scalar
    factors floored at EPS, and a full sort."""
    s_lp = torch.log_softmax(s_logits_NV / settings.crosstok_student_temperature, -1)
    t_lp = torch.log_softmax(t_logits_MW / settings.crosstok_teacher_temperature, -1)
    merged = []
    for lp, base, rows, groups, tokens in (
        (s_lp, plan.s_base_G, plan.s_scalar_Q, plan.s_scalar_group_Q, plan.s_scalar_token_Q),
        (t_lp, plan.t_base_G, plan.t_scalar_Q, plan.t_scalar_group_Q, plan.t_scalar_token_Q),
    ):
        factor = lp[rows, tokens].exp().clamp_min(divergence.EPS).log()
        log_c = torch.zeros(plan.num_groups, dtype=lp.dtype).index_add(0, groups, factor)
        merged.append((lp[base] + log_c.unsqueeze(1)).exp())
    return sorted_l1_reference(*merged)


@pytest.mark.parametrize("temps", [(1.0, 1.0), (0.7, 1.3)])
def test_uld_on_logit_rows_matches_plain_autograd(batch, temps):
    """The bench's path (ULD on logits rows, no head) against autograd through a full sort, float64."""
    settings = _settings("bayesian", False, "adaptive", True, temps)
    plan = _plan(batch, settings)
    s_hidden, t_hidden = _completion_rows(batch, plan, settings)
    s_logits = (s_hidden @ batch.s_head.T).requires_grad_()
    t_logits = t_hidden @ batch.t_head.T
    weights = torch.rand(plan.num_groups, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out = cross_tokenizer_divergence(s_logits, None, t_logits, None, plan, settings, group_weights_G=weights)
    (grad,) = torch.autograd.grad(out.sum, s_logits)
    ref_logits = s_logits.detach().clone().requires_grad_()
    ref = _direct(ref_logits, t_logits, plan, settings)
    (ref_grad,) = torch.autograd.grad((weights * ref).sum(), ref_logits)
    torch.testing.assert_close(out.per_group_G, ref.detach(), rtol=1e-9, atol=1e-15)
    # atol: entries m (s - A e^-c) where s and A e^-c nearly cancel carry rounding of the gradient's scale.
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-11 * ref_grad.abs().max().item())


def _completion_rows(batch, plan, cfg):
    rows = []
    for side, hidden in (("s", batch.s_hidden), ("t", batch.t_hidden)):
        rows.append(
            torch.cat(
                [
                    hidden[b, list(prediction_positions(len(r[f"{side}_prompt"]), len(r[side].ids), cfg))]
                    for b, r in enumerate(batch.rows)
                ]
            )
        )
    return rows


def test_only_the_head_or_only_the_rows_get_gradient(batch):
    settings = _settings("observed", False, "adaptive", True, (1.2, 1.0))
    plan = _plan(batch, settings)
    s_NH, t_MH = _completion_rows(batch, plan, settings)
    both_h, both_w = s_NH.clone().requires_grad_(), batch.s_head.clone().requires_grad_()
    args = (t_MH, batch.t_head, plan, settings)
    cross_tokenizer_divergence(both_h, both_w, *args, chunk_size=4).sum.backward()
    head = batch.s_head.clone().requires_grad_()
    (grad_w,) = torch.autograd.grad(cross_tokenizer_divergence(s_NH, head, *args).sum, head)
    rows = s_NH.clone().requires_grad_()
    (grad_h,) = torch.autograd.grad(cross_tokenizer_divergence(rows, batch.s_head, *args).sum, rows)
    torch.testing.assert_close(grad_w, both_w.grad)
    torch.testing.assert_close(grad_h, both_h.grad)


def test_no_groups_gives_a_zero_attached_to_the_graph():
    plan = align([Tokens([5], [2])], [Tokens([7], [4])], CrossTokenizerSettings())  # ends never meet
    assert plan.num_groups == 0
    s = torch.randn(1, 300, requires_grad=True)
    out = cross_tokenizer_divergence(s, None, torch.randn(1, 200), None, plan, CrossTokenizerSettings())
    out.sum.backward()
    assert out.sum.item() == 0.0 and out.per_group_G.shape == (0,) and not s.grad.any()


def test_merged_probabilities_keep_their_precision_far_below_one():
    """Groups whose scalar tokens multiply to e^-60 and e^-80 (near float32's smallest normal, e^-87) keep
    float32's relative precision: softmax(z) exp(c) against float64 (exp(log_softmax + c) in float32 is
    off by ~|log_softmax + c| ulps, 5e-6 here)."""
    gen = torch.Generator().manual_seed(4)
    z = 2 * torch.randn(3, 5000, generator=gen)
    log_c = torch.tensor([0.0, -60.0, -80.0])
    got = divergence._merge_(z.clone(), log_c).double()
    ref = (torch.log_softmax(z.double(), -1) + log_c.double().unsqueeze(1)).exp()
    normal = ref > torch.finfo(torch.float32).tiny
    assert normal[2].sum() > 100
    torch.testing.assert_close(got[normal], ref[normal], rtol=2e-6, atol=0)


def test_float32_agrees_with_float64(batch):
    """Loss and gradient in float32 against the same in float64, ULD at the kit's default chunk size."""
    settings = _settings("bayesian", False, "adaptive", True, (1.0, 1.0))
    plan = _plan(batch, settings)
    s_hidden, t_hidden = _completion_rows(batch, plan, settings)
    s_logits, t_logits = s_hidden @ batch.s_head.T, t_hidden @ batch.t_head.T
    results = []
    for dtype in (torch.float32, torch.float64):
        logits = s_logits.to(dtype).requires_grad_()
        out = cross_tokenizer_divergence(logits, None, t_logits.to(dtype), None, plan, settings)
        (grad,) = torch.autograd.grad(out.sum, logits)
        results.append((out.per_group_G.double(), grad.double()))
    (loss32, grad32), (loss64, grad64) = results
    torch.testing.assert_close(loss32, loss64, rtol=1e-5, atol=1e-9)
    assert (grad32 - grad64).norm() < 1e-5 * grad64.norm()
