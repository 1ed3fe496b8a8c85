"""The teacher as antidistillation sampling serves it for *scoring*: at every position the logits ADS samples
from, computed by one teacher-forcing forward of each model over the whole sequence (no decoding loop).

    direction = FiniteDifference(proxy, g, eps=1e-2)
    ads = ADSTeacher(teacher, direction, lam=0.1)
    logits_BTV = ads(input_ids=ids_BT, attention_mask=mask_BT).logits      # z_teacher + λ·Δ, raw
    trainer = DistillTrainer(..., teacher_model=ads)                        # 02's trainer scores with it

At every position t the logits are those `ads_sample` adds its warpers to,

    z_teacher + λ·Δ,   Δ = (z_proxy(θ+εg) − z_proxy(θ−εg)) / 2ε,

raw: the temperature (and, when sampling, top-k and top-p) is applied by whoever consumes them, as
`ads_processors` applies it after the ADS term. So softmax(logits[:, t] / τ) is the distribution
`ads_sample` draws token t+1 from at temperature τ (top-p 1); `DistillTrainer` compares at `kl_temperature`.

How it plugs into `DistillTrainer`, which never asks a teacher for logits: it takes the teacher's final hidden
states (`base_model(...).last_hidden_state`) and its head weight (`get_output_embeddings().weight`) and
forms the logits a chunk of rows at a time (`chunked_divergence`). Logits linear in a hidden state stay
linear when models are added, so the wrapper presents the three models as one:

    hidden = [h_teacher, c·h_plus, −c·h_minus],   head = [W_teacher | W_plus | W_minus],   c = λ / 2ε,

and hidden · headᵀ = z_teacher + c·(z_plus − z_minus), the ADS logits, without an N × V tensor. λ = 0
presents the teacher's own backbone and head, so scoring is exactly the plain teacher's.

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
from opdkit.rollout import sampling


def ads_term_scale(lam: float, eps: float) -> float:
    """c = λ / 2ε: the factor of z_plus − z_minus in the ADS logits."""
    return lam / (2 * eps)


class StackedBackbone(torch.nn.Module):
    """The final hidden states of teacher and both proxies side by side, the proxies' scaled by ±c, so that
    `stacked_head` turns them into the ADS logits; what `DistillTrainer` calls `base_model`."""

    def __init__(self, teacher: torch.nn.Module, plus: torch.nn.Module, minus: torch.nn.Module, scale: float):
        super().__init__()
        self.teacher, self.plus, self.minus, self.scale = teacher, plus, minus, scale

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutput:
        fwd = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        h_t_BTH, h_p_BTH, h_m_BTH = (
            m.base_model(**fwd).last_hidden_state for m in (self.teacher, self.plus, self.minus)
        )
        dtype = stacked_dtype(h_t_BTH.dtype, h_p_BTH.dtype)
        h_t_BTH, h_p_BTH, h_m_BTH = (h.to(dtype) for h in (h_t_BTH, h_p_BTH, h_m_BTH))
        return BaseModelOutput(
            last_hidden_state=torch.cat([h_t_BTH, self.scale * h_p_BTH, -self.scale * h_m_BTH], dim=-1)
        )


def stacked_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """At least fp32, and wide enough for every model stacked."""
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def stacked_head(teacher: torch.nn.Module, plus: torch.nn.Module, minus: torch.nn.Module) -> torch.nn.Linear:
    """[W_teacher | W_plus | W_minus] (at least fp32), with the teacher's rows: proxy rows past the teacher's
    dropped, missing ones zero (only the shared ids get the ADS term)."""
    weights = [m.get_output_embeddings().weight.detach() for m in (teacher, plus, minus)]
    dtype = stacked_dtype(*(w.dtype for w in weights))
    w_t_VH = weights[0].to(dtype)
    parts = [w_t_VH]
    for w in weights[1:]:
        w_VH = w.to(dtype)[: w_t_VH.shape[0]]
        pad_VH = w_VH.new_zeros(w_t_VH.shape[0] - w_VH.shape[0], w_VH.shape[1])
        parts.append(torch.cat([w_VH, pad_VH], dim=0).to(w_t_VH.device))
    weight_VH = torch.cat(parts, dim=1)
    head = torch.nn.Linear(
        weight_VH.shape[1], weight_VH.shape[0], bias=False, device=weight_VH.device, dtype=dtype
    )
    head.weight = torch.nn.Parameter(weight_VH, requires_grad=False)
    return head


def _check_head(model: torch.nn.Module, name: str) -> None:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError(
            f"the {name}'s output layer has a bias; ADSTeacher stacks bias-free heads (logits = hidden · Wᵀ)."
        )


class ADSTeacher(torch.nn.Module):
    """A frozen teacher whose logits at every position are the ADS logits z_teacher + λ·Δ (raw: temperature
    is the consumer's), for scoring a student's rollouts (`DistillTrainer(teacher_model=ADSTeacher(...))`).

    `forward` returns `.logits` (B, T, V) for any `Direction` (its `full`); the trainer's path
    (`base_model`, `get_output_embeddings`) stacks the perturbed proxies of a `FiniteDifference`.
    """

    def __init__(self, teacher: torch.nn.Module, direction: Direction | None, lam: float):
        super().__init__()
        lam = float(lam)
        if lam != 0 and direction is None:
            raise ValueError(
                f"lam={lam} needs a direction (FiniteDifference or JVP); only lam=0 runs without."
            )
        self.teacher = teacher.eval().requires_grad_(False)
        self.lam = lam
        self.direction = direction
        self.config = teacher.config
        self.backbone: torch.nn.Module = teacher.base_model
        self.head: torch.nn.Module = teacher.get_output_embeddings()
        if lam != 0 and isinstance(direction, FiniteDifference):
            plus, minus = direction.plus.model, direction.minus.model
            for name, model in (("teacher", teacher), ("proxy", plus)):
                _check_head(model, name)
            self.backbone = StackedBackbone(teacher, plus, minus, ads_term_scale(lam, direction.eps))
            self.head = stacked_head(teacher, plus, minus)

    @property
    def base_model(self) -> torch.nn.Module:
        """The final hidden states `get_output_embeddings()` turns into the ADS logits (the teacher's own at
        λ = 0)."""
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
        """The ADS logits (B, T, V) at every position, fp32, by the same arithmetic as `ADSLogitsProcessor`:
        the teacher's raw logits, plus λ·Δ on the shared ids. Positions follow the attention mask (left
        padding), as in sampling, unless given."""
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
        return CausalLMOutput(logits=z_BTV)
