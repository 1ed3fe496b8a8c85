"""Antidistillation sampling (ADS): the teacher's next-token logits, steered by a proxy student's gradient.

    g = gradfile.load_grads(grads_run, proxy, tokenizer)            # savegrad's mean completion gradient
    direction = FiniteDifference(proxy, g, eps=1e-2)             # two fp32 copies, θ+εg and θ−εg
    r = ads_sample(teacher, prompt_ids_BP, prompt_mask_BP, direction=direction, lam=0.1,
                   temperature=1.0, top_p=0.95, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, max_new_tokens=40)          # a sampling.Rollout

Each step the teacher samples from

    softmax( top_p( top_k( (z_teacher + λ·Δ) / τ ) ) ),
    Δ = (z_proxy(θ+εg) − z_proxy(θ−εg)) / 2ε ≈ ∂/∂ε z_proxy(θ+εg)|ε=0

where z are next-token logits, θ the proxy's weights and g the saved gradient. `JVP` computes the same
Δ exactly, with `torch.func.jvp` in direction g (no KV cache: for checks and small models).

Why positive λ is *anti*-distillation (the sign, from first principles). g = ∇θ ℓ(θ), where ℓ is the
proxy's mean completion NLL on held-out teacher traces, i.e. how badly a student that distils the
teacher still does. A student that distils a sampled token v takes one step on −log p(v | prefix):
θ' = θ + η ∇θ log p(v). Its held-out loss then changes by

    ℓ(θ') − ℓ(θ) ≈ η · g·∇θ log p(v) = η · (g·∇θ z_v − Σ_u p(u) g·∇θ z_u) = η · (Δ_v − E_p[Δ]),

because log p(v) = z_v − logsumexp(z) and g·∇θ z_v = Δ_v is the directional derivative above. So the
tokens with the largest Δ are those whose distillation *raises* the student's held-out loss most;
adding +λΔ with λ > 0 up-weights them. (The −E_p[Δ] term is the same for every token and cancels in
the softmax, which is why logits, not log-probabilities, may be differenced.) The ADS reference code
adds +λ(z(θ+εg) − z(θ−εg))/2ε with g the gradient of the NLL, the same convention. tests/test_ads_direction.py
checks the sign numerically: one SGD step of the proxy on each candidate token, the held-out loss
measured before and after.

Pitfalls this module exists for:
- the perturbation εg is tiny next to the weights (RMS ~1e-3 of them in the tiny world at ε=1e-2):
  in bf16 (8 bits of mantissa) most of θ±εg rounds back to θ, and Δ is noise. Both copies are kept in
  fp32 whatever the proxy was loaded in (the reference casts them back to fp16);
- the order of operations: λΔ is added to the *raw* teacher logits, then temperature, then top-p, as
  the reference does. `ads_sample` puts temperature and top-p into its own processor list, after the
  ADS term, and calls `sampling.sample` with temperature 1 and top-p 1, which applies the list in
  order and nothing else (no top-k, nothing from the checkpoint's generation config);
- each perturbed proxy keeps its own KV cache; the first processor call of a batch feeds the whole
  left-padded prompt with positions from its attention mask (as the sampler does), every later call
  feeds only the newest token at the next position;
- teacher and proxy must share a tokenizer (ids index the same tokens); where one model pads its
  vocabulary beyond the other's, only the shared ids get the ADS term.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Protocol

import torch
from transformers import DynamicCache

from opdkit.rollout import sampling
from opdkit.settings import ADS_METHODS


class Direction(Protocol):
    """Δ_BV, the derivative of the proxy's next-token logits along g, for a batch being generated."""

    def start(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor: ...

    def step(self, new_ids_B1: torch.Tensor) -> torch.Tensor: ...

    def full(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor: ...

    def to(self, device: torch.device | str) -> Direction: ...


def _check_grads(model: torch.nn.Module, grads: Mapping[str, torch.Tensor]) -> None:
    names = {n for n, _ in model.named_parameters()}
    missing, extra = sorted(names - set(grads)), sorted(set(grads) - names)
    if missing or extra:
        raise ValueError(
            f"the gradient does not fit the proxy: {len(missing)} parameter(s) without a gradient (e.g. "
            f"{missing[:2]}), {len(extra)} gradient(s) without a parameter (e.g. {extra[:2]}); load it with "
            "opdkit.ads.gradfile.load_grads(run_dir, proxy, tokenizer), which checks this against the proxy "
            "it belongs to."
        )


def perturbed_copy(
    proxy: torch.nn.Module, grads: Mapping[str, torch.Tensor], scale: float
) -> torch.nn.Module:
    """An fp32, eval-mode, gradient-free copy of `proxy` with weights θ + scale·g (added in fp32)."""
    _check_grads(proxy, grads)
    model = copy.deepcopy(proxy).float().eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(grads[name].to(p.device, torch.float32), alpha=scale)
    return model


def rounded_away_fraction(weight: torch.Tensor, delta: torch.Tensor, dtype: torch.dtype) -> float:
    """Fraction of the entries of `weight + delta` that round back to `weight` when stored in `dtype`."""
    w = weight.detach().float()
    return float(((w + delta.float()).to(dtype) == w.to(dtype)).float().mean())


def _last_logits(model: torch.nn.Module, **kwargs) -> torch.Tensor:
    return model(**kwargs, logits_to_keep=1).logits[:, -1, :].float()


class CachedLM:
    """A causal LM run incrementally with its own KV cache: the whole (left-padded) prompt, then one token
    per step."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.kwarg = sampling.cache_kwarg(model)
        self.cache: DynamicCache | None = None
        self.mask_BT: torch.Tensor | None = None
        self.next_pos_B1: torch.Tensor | None = None

    @torch.no_grad()
    def start(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        self.cache = DynamicCache(config=self.model.config)
        self.mask_BT = attention_mask_BT.long()
        pos_BT = sampling.position_ids_from_mask(self.mask_BT)
        self.next_pos_B1 = pos_BT[:, -1:] + 1
        return _last_logits(
            self.model,
            input_ids=input_ids_BT,
            attention_mask=self.mask_BT,
            position_ids=pos_BT,
            use_cache=True,
            **{self.kwarg: self.cache},
        )

    @torch.no_grad()
    def step(self, new_ids_B1: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("step() before start(): feed the prompt first.")
        self.mask_BT = torch.cat([self.mask_BT, torch.ones_like(new_ids_B1)], dim=1)
        logits = _last_logits(
            self.model,
            input_ids=new_ids_B1,
            attention_mask=self.mask_BT,
            position_ids=self.next_pos_B1,
            use_cache=True,
            **{self.kwarg: self.cache},
        )
        self.next_pos_B1 = self.next_pos_B1 + 1
        return logits


class FiniteDifference:
    """Δ = (z(θ+εg) − z(θ−εg)) / 2ε from two fp32 proxy copies, each with its own KV cache."""

    def __init__(self, proxy: torch.nn.Module, grads: Mapping[str, torch.Tensor], eps: float = 1e-2):
        if not eps > 0:
            raise ValueError(f"eps={eps} must be positive: it is the finite-difference step along g.")
        self.eps = eps
        self.plus = CachedLM(perturbed_copy(proxy, grads, eps))
        self.minus = CachedLM(perturbed_copy(proxy, grads, -eps))

    def _diff(self, z_plus: torch.Tensor, z_minus: torch.Tensor) -> torch.Tensor:
        return (z_plus - z_minus) / (2 * self.eps)

    def start(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        return self._diff(
            self.plus.start(input_ids_BT, attention_mask_BT),
            self.minus.start(input_ids_BT, attention_mask_BT),
        )

    def step(self, new_ids_B1: torch.Tensor) -> torch.Tensor:
        return self._diff(self.plus.step(new_ids_B1), self.minus.step(new_ids_B1))

    def to(self, device: torch.device | str) -> FiniteDifference:
        """Move both copies (e.g. off the GPU while a student trains); the caches are dropped."""
        for m in (self.plus, self.minus):
            m.model.to(device)
            m.cache = None
        return self

    @torch.no_grad()
    def full(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """Δ_BTV at every position, from scratch (no cache)."""
        pos = sampling.position_ids_from_mask(attention_mask_BT)
        z = [
            m.model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=pos).logits.float()
            for m in (self.plus, self.minus)
        ]
        return self._diff(*z)


class JVP:
    """Δ = g·∇θ z(θ) exactly, by forward-mode differentiation (`torch.func.jvp`) of the fp32 proxy.

    No KV cache: every step re-runs the whole prefix, so this is for checks and small models.
    """

    def __init__(self, proxy: torch.nn.Module, grads: Mapping[str, torch.Tensor]):
        _check_grads(proxy, grads)
        self.model = copy.deepcopy(proxy).float().eval().requires_grad_(False)
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation("eager")  # forward-mode AD through plain matmuls and softmax
        self.params = {n: p.detach() for n, p in self.model.named_parameters()}
        self.tangents = {n: grads[n].to(p.device, torch.float32) for n, p in self.params.items()}
        self.ids_BT: torch.Tensor | None = None
        self.mask_BT: torch.Tensor | None = None

    def full(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        """Δ_BTV at every position."""
        pos = sampling.position_ids_from_mask(attention_mask_BT)

        def logits(params: dict[str, torch.Tensor]) -> torch.Tensor:
            kwargs = {"input_ids": input_ids_BT, "attention_mask": attention_mask_BT, "position_ids": pos}
            return torch.func.functional_call(self.model, params, (), kwargs).logits.float()

        with torch.no_grad():
            _, tangent = torch.func.jvp(logits, (self.params,), (self.tangents,))
        return tangent

    def to(self, device: torch.device | str) -> JVP:
        self.model.to(device)
        self.params = {n: p.detach() for n, p in self.model.named_parameters()}
        self.tangents = {n: t.to(device) for n, t in self.tangents.items()}
        return self

    def start(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
        self.ids_BT, self.mask_BT = input_ids_BT, attention_mask_BT.long()
        return self.full(self.ids_BT, self.mask_BT)[:, -1, :]

    def step(self, new_ids_B1: torch.Tensor) -> torch.Tensor:
        if self.ids_BT is None:
            raise RuntimeError("step() before start(): feed the prompt first.")
        self.ids_BT = torch.cat([self.ids_BT, new_ids_B1], dim=1)
        self.mask_BT = torch.cat([self.mask_BT, torch.ones_like(new_ids_B1)], dim=1)
        return self.full(self.ids_BT, self.mask_BT)[:, -1, :]


def make_direction(
    method: str, proxy: torch.nn.Module, grads: Mapping[str, torch.Tensor], eps: float
) -> Direction:
    if method == "fd":
        return FiniteDifference(proxy, grads, eps)
    if method == "jvp":
        return JVP(proxy, grads)
    raise ValueError(f"method={method!r} is not one of {list(ADS_METHODS)}.")
