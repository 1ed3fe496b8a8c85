"""The teacher as antidistillation sampling serves it for *scoring*: at every position the logits ADS samples
from, computed by one teacher-forcing forward of each model over the whole sequence (no decoding loop).

    direction = FiniteDifference(proxy, g, eps=1e-2)
    ads = ADSTeacher(teacher, direction, lam=0.1)
    logits_BTV = ads(input_ids=ids_BT, attention_mask=mask_BT).logits      # z_teacher + λ·Δ, raw
    served = ADSTeacher(teacher, direction, lam=0.1, temperature=0.8)       # (z_teacher + λ·Δ) / 0.8
    trainer = DistillTrainer(..., teacher_model=served)                     # 02's trainer scores with it

At every position t the logits are those `ads_sample` adds its warpers to,

    z_teacher + λ·Δ,   Δ = (z_proxy(θ+εg) − z_proxy(θ−εg)) / 2ε,

raw: the temperature (and, when sampling, top-k and top-p) is applied by whoever consumes them, as
`ads_processors` applies it after the ADS term. So softmax(logits[:, t] / τ) is the distribution
`ads_sample` draws token t+1 from at temperature τ (top-p 1). `DistillTrainer` compares at `kl_temperature`,
which divides the student's logits too; a teacher that serves the log-probabilities of the distribution it
samples from at τ is `temperature=τ`: (z_teacher + λ·Δ) / τ, the ADS term first, as in sampling.

How it plugs into `DistillTrainer`, which never asks a teacher for logits: it is a teacher in process (a
kind of `opd.teachers.local.LocalTeacher`, which reads any module that presents these two, here itself):
its final hidden states (`base_model(...).last_hidden_state`) and its head weight
(`get_output_embeddings().weight`), from which the divergence forms the logits a chunk of rows at a time
(`chunked_divergence`). Logits linear in a hidden state stay linear when models are added, so the wrapper
presents the three models as one:

    hidden = [h_teacher, c·h_plus, −c·h_minus] / τ,   head = [W_teacher | W_plus | W_minus],   c = λ / 2ε,

and hidden · headᵀ = (z_teacher + c·(z_plus − z_minus)) / τ, the ADS logits, without an N × V tensor. λ = 0
and τ = 1 present the teacher's own backbone and head, so scoring is exactly the plain teacher's.

Pitfalls this module exists for:
- the same order of terms as sampling: λΔ is added to the raw logits, never after a temperature;
- the proxies stay fp32 (their perturbation εg rounds away in bf16), so the stacked head is fp32 even
  for a bf16 teacher: the teacher's hidden states and head are upcast exactly, and its logits are then
  an fp32 matmul of bf16 values (sampling's are the bf16 model's own matmul, the same to bf16 rounding);
- teacher and proxy may pad their vocabularies differently: as in `ADSLogitsProcessor`, only the shared
  ids get the ADS term (the proxy's rows past the teacher's are dropped, missing ones are zero);
- the stacked head is V × (H_teacher + 2·H_proxy) fp32, built once: 2.8 GB for Qwen3-4B with a
  Qwen3-0.6B proxy; the hidden states N × that width, a few MB per thousand tokens.
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from opdkit.ads.direction import Direction, FiniteDifference
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.rollout import sampling


def ads_term_scale(lam: float, eps: float) -> float:
    """c = λ / 2ε: the factor of z_plus − z_minus in the ADS logits."""
    return lam / (2 * eps)


def stacked_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """At least fp32, and wide enough for every model stacked."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


class StackedBackbone(torch.nn.Module):
    """The final hidden states of several models side by side, each times its coefficient, so that
    `stacked_head` turns them into Σ coefficient · logits; what `DistillTrainer` calls `base_model`."""

    def __init__(self, models: list[torch.nn.Module], coefficients: list[float]):
        super().__init__()
        self.models = torch.nn.ModuleList(models)
        self.coefficients = list(coefficients)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        fwd = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        hidden = [m.base_model(**fwd).last_hidden_state for m in self.models]
        dtype = stacked_dtype(*(h_BTH.dtype for h_BTH in hidden))
        scaled = [c * h_BTH.to(dtype) for c, h_BTH in zip(self.coefficients, hidden)]
        return BaseModelOutput(last_hidden_state=torch.cat(scaled, dim=-1))


def stacked_head(models: list[torch.nn.Module]) -> torch.nn.Linear:
    """The models' output weights side by side (at least fp32), with the first model's rows: rows of the
    others past its own dropped, missing ones zero (only the shared ids get the ADS term)."""
    weights = [m.get_output_embeddings().weight.detach() for m in models]
    dtype = stacked_dtype(*(w.dtype for w in weights))
    rows, dev = weights[0].shape[0], weights[0].device
    parts = []
    for w in weights:
        w_VH = w.to(dev, dtype)[:rows]
        parts.append(torch.cat([w_VH, w_VH.new_zeros(rows - w_VH.shape[0], w_VH.shape[1])], dim=0))
    weight_VH = torch.cat(parts, dim=1)
    head = torch.nn.Linear(weight_VH.shape[1], rows, bias=False, device=dev, dtype=dtype)
    head.weight = torch.nn.Parameter(weight_VH, requires_grad=False)
    return head


def _check_head(model: torch.nn.Module) -> None:
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        raise ValueError(
            f"{type(model).__name__}'s output layer has a bias; ADSTeacher stacks bias-free heads "
            "(logits = hidden · Wᵀ)."
        )


class ADSTeacher(LocalTeacher, torch.nn.Module):
    """A frozen teacher whose logits at every position are the ADS logits (z_teacher + λ·Δ) / τ, for scoring a
    student's rollouts (`DistillTrainer(teacher_model=ADSTeacher(...))`: a teacher kind in process, the
    module it holds itself). τ = `temperature` = 1 serves them raw, for a consumer that applies its own
    temperature.

    `forward` returns `.logits` (B, T, V) for any `Direction` (its `full`); the trainer's path
    (`base_model`, `get_output_embeddings`) stacks the perturbed proxies of a `FiniteDifference`.
    """

    name = "ADS teacher"

    def __init__(
        self, teacher: torch.nn.Module, direction: Direction | None, lam: float, temperature: float = 1.0
    ):
        torch.nn.Module.__init__(self)
        lam, temperature = float(lam), float(temperature)
        if lam != 0 and direction is None:
            raise ValueError(
                f"lam={lam} needs a direction (FiniteDifference or JVP); only lam=0 runs without."
            )
        if not temperature > 0:
            raise ValueError(f"temperature={temperature} must be positive: the logits are divided by it.")
        self.teacher = teacher.eval().requires_grad_(False)
        self.lam, self.temperature, self.direction = lam, temperature, direction
        self.config = teacher.config
        self.backbone: torch.nn.Module = teacher.base_model
        self.head: torch.nn.Module = teacher.get_output_embeddings()
        stack, coefficients = [teacher], [1 / temperature]
        if lam != 0 and isinstance(direction, FiniteDifference):
            c = ads_term_scale(lam, direction.eps)
            stack += [direction.plus.model, direction.minus.model]
            coefficients += [c / temperature, -c / temperature]
        if len(stack) > 1 or temperature != 1:
            for model in stack:
                _check_head(model)
            self.backbone, self.head = StackedBackbone(stack, coefficients), stacked_head(stack)
        self.sharded = False
        self.eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self

    @property
    def base_model(self) -> torch.nn.Module:
        """The final hidden states `get_output_embeddings()` turns into the ADS logits (the teacher's own at
        λ = 0, τ = 1)."""
        if self.lam != 0 and not isinstance(self.direction, FiniteDifference):
            raise NotImplementedError(
                f"{type(self.direction).__name__} has no perturbed proxies to stack; score with a "
                "FiniteDifference direction (ads_method fd), or use forward()'s logits."
            )
        return self.backbone

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        """The ADS logits (B, T, V) at every position, fp32, by the same arithmetic as `ads_processors`: the
        teacher's raw logits, plus λ·Δ on the shared ids, then divided by τ. Positions follow the attention
        mask (left padding), as in sampling, unless given."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = sampling.position_ids_from_mask(attention_mask)
        z_BTV = self.teacher(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
        ).logits.float()
        if self.lam != 0:
            d_BTV = self.direction.full(input_ids, attention_mask)
            v = min(z_BTV.shape[-1], d_BTV.shape[-1])
            z_BTV[..., :v] += self.lam * d_BTV[..., :v].to(z_BTV.device)
        if self.temperature != 1:
            z_BTV = z_BTV / self.temperature
        return CausalLMOutput(logits=z_BTV)
