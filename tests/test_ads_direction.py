"""The ADS direction Δ (opdkit.ads.direction): the finite difference against the exact JVP and the JVP
against autograd, the KV-cached steps inside generate against a full recomputation, fp32 perturbations of a
bf16 proxy, a gradient that does not fit the proxy, the sign of the ADS term measured on the proxy itself,
and directions moved between devices."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import tiny_model, tiny_prompts, tiny_rollout

from opdkit.ads import gradfile
from opdkit.ads.direction import JVP, Direction, FiniteDifference, make_direction, rounded_away_fraction
from opdkit.ads.sampler import ads_sample
from opdkit.data import traces
from opdkit.data.labels import make_batches, token_losses
from opdkit.rollout import sampling


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("eps,tol", [(1e-3, 2e-3), (1e-2, 2e-2)])
def test_finite_difference_matches_the_exact_jvp(teacher, proxy, g, tok, eps, tol):
    r = tiny_rollout(teacher, tok)
    fd = FiniteDifference(proxy, g, eps).full(r.input_ids_BT, r.attention_mask_BT)
    exact = JVP(proxy, g).full(r.input_ids_BT, r.attention_mask_BT)
    real = r.attention_mask_BT.bool()
    assert exact[real].abs().max() > 1.0  # a direction that moves the logits, not a trivial zero
    assert _rel_err(fd[real], exact[real]) < tol


def test_jvp_is_the_directional_derivative_autograd_gives(proxy, g, tok):
    """Δ_v = g·∇θ z_v, by reverse mode on one prefix, against the JVP."""
    ids, mask = tiny_prompts(tok, 1)
    exact = JVP(proxy, g).full(ids, mask)[0, -1]
    model = copy.deepcopy(proxy)
    for v in (5, 17, 40):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask).logits[0, -1, v].backward()
        dot = sum((p.grad * g[n]).sum() for n, p in model.named_parameters())
        assert float(dot) == pytest.approx(float(exact[v]), rel=1e-4, abs=1e-4)


class _Recorder:
    """A Direction that records what it returns at every step of a generate call."""

    def __init__(self, inner: Direction):
        self.inner, self.deltas = inner, []

    def start(self, ids, mask):
        self.deltas = [self.inner.start(ids, mask)]
        return self.deltas[-1]

    def step(self, new):
        self.deltas.append(self.inner.step(new))
        return self.deltas[-1]

    def full(self, ids, mask):
        return self.inner.full(ids, mask)


@pytest.mark.parametrize("method", ["fd", "jvp"])
def test_cached_steps_give_the_delta_of_a_full_recomputation(teacher, proxy, g, tok, method):
    """Inside generate, with left-padded prompts: each step's Δ equals Δ recomputed on the whole prefix."""
    direction = make_direction(method, proxy, g, 1e-2)
    rec = _Recorder(direction)
    ids, mask = tiny_prompts(tok)
    torch.manual_seed(0)
    r = ads_sample(
        teacher,
        ids,
        mask,
        direction=rec,
        lam=0.05,
        temperature=1.0,
        top_p=1.0,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=40,
    )
    full = direction.full(r.input_ids_BT, r.attention_mask_BT)
    P = r.prompt_len
    assert len(rec.deltas) >= 10
    for k, d in enumerate(rec.deltas):
        # the step predicting completion token k saw the prompt and tokens < k; rows already past their EOS
        # were fed padding by generate and are not part of any trace
        live = torch.ones(len(d), dtype=torch.bool) if k == 0 else r.completion_mask_BC[:, k - 1].bool()
        torch.testing.assert_close(d[live], full[live, P - 1 + k], rtol=1e-4, atol=2e-3)


def test_perturbations_are_kept_in_fp32_even_for_a_bf16_proxy(g):
    bf16 = tiny_model("tiny:student", torch.bfloat16)
    eps = 1e-2
    fd = FiniteDifference(bf16, g, eps)
    name = "model.layers.0.mlp.down_proj.weight"
    plus, minus = dict(fd.plus.model.named_parameters())[name], dict(fd.minus.model.named_parameters())[name]
    base = dict(bf16.named_parameters())[name].float()
    assert plus.dtype == minus.dtype == torch.float32
    torch.testing.assert_close(plus - minus, 2 * eps * g[name], rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(plus - base, eps * g[name], rtol=1e-3, atol=1e-6)
    # why: stored in bf16, most of θ + εg would round back to θ (the ADS reference keeps fp16 copies)
    assert rounded_away_fraction(base, eps * g[name], torch.bfloat16) > 0.5
    assert rounded_away_fraction(base, eps * g[name], torch.float32) < 0.01


def test_gradient_that_does_not_fit_the_proxy_is_refused(grads_run, tok, g):
    with pytest.raises(gradfile.GradsMismatch, match="does not fit this model"):
        gradfile.load_grads(grads_run, tiny_model("tiny:teacher"), tok)
    with pytest.raises(ValueError, match="does not fit the proxy"):
        FiniteDifference(tiny_model("tiny:teacher"), g)


def _holdout_loss(model: torch.nn.Module, rows: list[dict], pad: int) -> float:
    """The proxy's mean-over-traces completion NLL: the loss whose gradient 01_save_grad saved."""
    with torch.no_grad():
        batch = next(make_batches(rows, list(range(len(rows))), len(rows), pad, "cpu"))
        loss_sum, n = token_losses(model, batch)
        return float((loss_sum / n).mean())


def test_positive_lambda_makes_a_distillation_step_raise_the_holdout_loss(grads_run, proxy, teacher, g, tok):
    """The sign, measured: one small SGD step of the proxy on a token v changes its held-out loss by about
    η(Δ_v − E_p[Δ]); so the expected change under ADS sampling (λ > 0) exceeds plain sampling's, and λ < 0
    lowers it."""
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in traces.load_traces(grads_run)]
    base = _holdout_loss(proxy, rows, tok.pad_token_id)
    r = tiny_rollout(teacher, tok, seed=1)
    eta, checked = 1e-4, 0
    for b, cut in ((2, 5), (4, 9)):
        T = r.prompt_len + cut
        ids, mask = r.input_ids_BT[b : b + 1, :T], r.attention_mask_BT[b : b + 1, :T]
        pos = sampling.position_ids_from_mask(mask)
        delta = JVP(proxy, g).full(ids, mask)[0, -1]
        change = torch.empty(len(tok))
        for v in range(len(tok)):  # the whole vocabulary: the expectations below are exact, not sampled
            model = copy.deepcopy(proxy)
            logp = (
                model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, -1].log_softmax(-1)[v]
            )
            step = torch.autograd.grad(logp, list(model.parameters()))
            with torch.no_grad():
                for p, s in zip(model.parameters(), step):
                    p.add_(s, alpha=eta)  # θ' = θ + η∇log p(v): a step on the distillation loss −log p(v)
            change[v] = (_holdout_loss(model, rows, tok.pad_token_id) - base) / eta
        with torch.no_grad():
            p_proxy = proxy(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, -1].softmax(-1)
            z = teacher(input_ids=ids, attention_mask=mask, position_ids=pos).logits[0, -1]
        predicted = delta - (p_proxy * delta).sum()
        assert torch.corrcoef(torch.stack([change, predicted]))[0, 1] > 0.9
        expected = {lam: float(((z + lam * delta).softmax(-1) * change).sum()) for lam in (-0.1, 0.0, 0.1)}
        assert expected[0.1] > expected[0.0] > expected[-0.1]
        checked += 1
    assert checked == 2


@pytest.mark.parametrize("method", ["fd", "jvp"])
def test_directions_move_between_devices_unchanged(proxy, g, tok, method):
    ids, mask = tiny_prompts(tok, 2)
    direction = make_direction(method, proxy, g, 1e-2)
    before = direction.start(ids, mask)
    torch.testing.assert_close(direction.to("cpu").start(ids, mask), before)
