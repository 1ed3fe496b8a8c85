"""The distillation loss: generalized Jensen-Shannon divergence between student and teacher tokens.

    loss = generalized_jsd(student_logits_BTV, teacher_logits_BTV, mask=completion_mask_BT, beta=1.0)
    out = chunked_divergence(s_hidden_NH, student.lm_head.weight, t_hidden_NH, teacher.lm_head.weight,
                             beta=1.0, vocab_size=len(tokenizer))
    (out.sum / num_completion_tokens_in_step).backward()

Convention (the same as TRL's `GKDTrainer.generalized_jsd_loss`): with student S, teacher T and the
mixture M = (1 - beta) * S + beta * T, the per-token divergence is
beta * KL(T || M) + (1 - beta) * KL(S || M), except at the ends where it is the plain KL:
beta = 0 is forward KL(T || S) (mode covering) and beta = 1 is reverse KL(S || T) (mode seeking, the
usual on-policy distillation choice).

Pitfalls this module exists for:
- the mixed divergence tends to beta * KL(T || S) as beta -> 0, not to KL(T || S): the loss scale (and
  so the useful learning rate) jumps at the ends; this follows TRL so results stay comparable;
- everything is done in log space (log_softmax, logaddexp) so low temperatures stay finite, and in at
  least float32 even when the logits are bfloat16;
- a full N x V float32 logits tensor for both models does not fit next to a Qwen3-sized vocabulary
  (151,936 rows), so `chunked_divergence` works from final hidden states a chunk of rows at a time and
  recomputes each chunk's logits in the backward pass instead of keeping them;
- real models pad their embedding matrix beyond the tokenizer, differently per model; `vocab_size`
  slices both heads to the tokenizer's vocabulary so padding rows never enter the softmax;
- a sampler (vLLM) reports log-probabilities at temperature 1 over the model's whole head, padding rows
  included: `target_ids_N` gathers the student's log-probability of each sampled token the same way, from
  the logits the chunk computes anyway, so comparing with the sampler costs no second forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DivergenceOutput:
    """What `chunked_divergence` returns for N completion tokens."""

    sum: torch.Tensor  # scalar, differentiable: per-token divergence summed over the N rows
    per_token_N: torch.Tensor  # detached, for logging
    student_entropy_N: torch.Tensor  # detached entropy of the student's temperature-scaled distribution
    # Detached log-probability of each row's target token at temperature 1 over the student's whole head
    # (padding rows included, as a sampler's); None without `target_ids_N`.
    student_token_logprob_N: torch.Tensor | None = None


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over masked tokens of the per-token generalized JSD; logits (..., V), mask (...).

    Gradient flows to whichever logits require it; a frozen teacher's simply do not.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same shape; slice both to the tokenizer's "
            "vocabulary (logits[..., :len(tokenizer)]) if the models pad their heads differently"
        )
    vocab = student_logits.shape[-1]
    student_logits_NV = student_logits.reshape(-1, vocab)
    teacher_logits_NV = teacher_logits.reshape(-1, vocab)
    if mask is not None:
        if mask.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"mask {tuple(mask.shape)} must match the logits without their vocabulary dimension, "
                f"{tuple(student_logits.shape[:-1])}; pass the completion mask of the same batch"
            )
        mask_N = mask.reshape(-1).bool()
        # Selecting rows first skips the softmax work on padding.
        student_logits_NV = student_logits_NV[mask_N]
        teacher_logits_NV = teacher_logits_NV[mask_N]
    if student_logits_NV.shape[0] == 0:
        raise ValueError(
            "the mask selects no tokens, so the mean divergence is undefined; drop empty batches or "
            "check that the mask marks completion tokens with 1/True"
        )
    return per_token_divergence(student_logits_NV, teacher_logits_NV, beta, temperature).mean()


def per_token_divergence(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized JSD of each of the N rows, shape (N,), in float32 or wider."""
    _check_hparams(beta, temperature)
    logp_s_NV = _log_probs(student_logits_NV, temperature)
    logp_t_NV = _log_probs(teacher_logits_NV, temperature)
    return _divergence_N(logp_s_NV, logp_t_NV, beta)


def chunked_divergence(
    student_hidden_NH: torch.Tensor,
    student_head_weight_VH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor,
    teacher_head_weight_VH: torch.Tensor,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = 1024,
    target_ids_N: torch.Tensor | None = None,
) -> DivergenceOutput:
    """Summed per-token divergence from final (post-norm) hidden states and bias-free lm_head weights.

    Peak memory is two chunk_size x V float32 buffers (plus the head's float32 gradient in the
    backward pass) instead of several N x V tensors;
    the price is running both heads' matmuls again in the backward pass. Gradient reaches the
    student's hidden states and head weight; the teacher's inputs are detached. With `target_ids_N`
    (the token each row predicts) the output also carries the student's log-probability of it.
    """
    _check_hparams(beta, temperature)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    n_rows = student_hidden_NH.shape[0]
    if student_hidden_NH.dim() != 2 or teacher_hidden_NH.dim() != 2 or teacher_hidden_NH.shape[0] != n_rows:
        raise ValueError(
            f"student_hidden_NH {tuple(student_hidden_NH.shape)} and teacher_hidden_NH "
            f"{tuple(teacher_hidden_NH.shape)} must both be (N, H) with the same N; gather the same "
            "completion positions from both models"
        )
    for name, hidden_NH, weight_VH in (
        ("student", student_hidden_NH, student_head_weight_VH),
        ("teacher", teacher_hidden_NH, teacher_head_weight_VH),
    ):
        if weight_VH.dim() != 2 or weight_VH.shape[1] != hidden_NH.shape[1]:
            raise ValueError(
                f"{name} head weight {tuple(weight_VH.shape)} must be (V, H) with H = {hidden_NH.shape[1]} "
                f"from the {name} hidden states; pass model.lm_head.weight and the final-norm hidden states"
            )
    vocab = _shared_vocab_size(student_head_weight_VH.shape[0], teacher_head_weight_VH.shape[0], vocab_size)
    if target_ids_N is not None and tuple(target_ids_N.shape) != (n_rows,):
        raise ValueError(
            f"target_ids_N {tuple(target_ids_N.shape)} must hold one token id per hidden row, ({n_rows},); "
            "pass the token each completion position predicts"
        )
    div_N, entropy_N, token_logprob_N = _ChunkedDivergence.apply(
        student_hidden_NH,
        student_head_weight_VH,
        teacher_hidden_NH.detach(),
        teacher_head_weight_VH.detach(),
        _ChunkSpec(vocab, beta, temperature, chunk_size),
        target_ids_N,
    )
    # An empty batch still gives a sum attached to the student's graph (its gradient is zero): under
    # DDP/FSDP every rank must run backward through the same parameters.
    return DivergenceOutput(
        sum=div_N.sum(),
        per_token_N=div_N.detach(),
        student_entropy_N=entropy_N,
        student_token_logprob_N=None if target_ids_N is None else token_logprob_N,
    )


@dataclass(frozen=True)
class _ChunkSpec:
    vocab: int
    beta: float
    temperature: float
    chunk_size: int


class _ChunkedDivergence(torch.autograd.Function):
    """Per-token divergence and student entropy from hidden states, one chunk of rows at a time.

    Forward keeps only each row's log-sum-exps and divergence (and, given target ids, the student's
    log-probability of each target at temperature 1, read off the same logits); backward recomputes a
    chunk's logits from the saved inputs and turns them into the logits' gradient in place, so a chunk
    needs two chunk x V float32 buffers (autograd through the same math keeps six to eight) and elementwise
    work runs on blocks of rows. At the ends the logits' gradient has a closed form (z: the
    temperature-scaled student logits, p = softmax(z), q the teacher's); mixed beta differentiates
    `_divergence_N` one block of rows at a time.
    """

    @staticmethod
    def forward(ctx, s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec: _ChunkSpec, target_N=None):
        heads = _Heads.build(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec)
        n_rows = s_hidden_NH.shape[0]
        div_N = s_hidden_NH.new_empty(n_rows, dtype=heads.softmax_dtype)
        entropy_N, lse_s_N, lse_t_N = (
            torch.empty_like(div_N),
            torch.empty_like(div_N),
            torch.empty_like(div_N),
        )
        token_logprob_N = torch.empty_like(div_N) if target_N is not None else div_N.new_empty(0)
        for rows in heads.chunks(n_rows):
            s_logits_RV = heads.student_logits(rows)
            if target_N is not None:  # read before the softmax below overwrites the logits
                target_logit_R, raw_lse_R = heads.student_target_logits(rows, s_logits_RV, target_N[rows])
            logp_s_RV, lse_s_N[rows] = _log_softmax_(s_logits_RV, spec.temperature)
            if target_N is not None:
                token_logprob_N[rows] = target_logit_R - (lse_s_N[rows] if raw_lse_R is None else raw_lse_R)
            logp_t_RV, lse_t_N[rows] = _log_softmax_(heads.teacher_logits(rows), spec.temperature)
            div_N[rows], entropy_N[rows] = _chunk_forward(logp_s_RV, logp_t_RV, spec.beta)
            del s_logits_RV, logp_s_RV, logp_t_RV  # free both before the next chunk's logits exist
        ctx.save_for_backward(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, lse_s_N, lse_t_N, div_N)
        ctx.spec, ctx.dtypes = spec, heads.dtypes
        ctx.mark_non_differentiable(entropy_N, token_logprob_N)
        return div_N, entropy_N, token_logprob_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_div_N, _grad_entropy_N, _grad_token_logprob_N):
        s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, lse_s_N, lse_t_N, div_N = ctx.saved_tensors
        spec = ctx.spec
        heads = _Heads.build(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec, ctx.dtypes)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_NH = torch.zeros_like(s_hidden_NH) if want_h else None
        # Accumulated in (at least) float32 over the full head, so its padding rows get an exact zero.
        grad_w_VH = s_w_VH.new_zeros(s_w_VH.shape, dtype=heads.softmax_dtype) if want_w else None
        for rows in heads.chunks(s_hidden_NH.shape[0]):
            lse_s_R, lse_t_R = lse_s_N[rows].unsqueeze(1), lse_t_N[rows].unsqueeze(1)
            logp_s_RV = heads.student_logits(rows).div_(spec.temperature).sub_(lse_s_R)
            logp_t_RV = heads.teacher_logits(rows).div_(spec.temperature).sub_(lse_t_R)
            grad_z_RV = _chunk_logits_grad_(logp_s_RV, logp_t_RV, div_N[rows], spec.beta)
            del logp_s_RV, logp_t_RV  # grad_z_RV took logp_s_RV's place; logp_t_RV is free now
            grad_z_RV.mul_((grad_div_N[rows].to(grad_z_RV.dtype) / spec.temperature).unsqueeze(1))
            heads.accumulate_student_grads(rows, grad_z_RV.to(ctx.dtypes[0]), grad_h_NH, grad_w_VH)
            del grad_z_RV  # before the next chunk's logits exist
        if grad_w_VH is not None:
            grad_w_VH = grad_w_VH.to(s_w_VH.dtype)
        return grad_h_NH, grad_w_VH, None, None, None, None


@dataclass
class _Heads:
    """Both heads cast once to the matmul dtype (autocast's, as `F.linear` would use, else the
    weights'), sliced to the shared vocabulary, and the hidden rows they are applied to."""

    s_hidden_NH: torch.Tensor
    s_w_VH: torch.Tensor
    t_hidden_NH: torch.Tensor
    t_w_VH: torch.Tensor
    chunk_size: int
    s_w_pad_EH: torch.Tensor  # the student head's rows beyond the shared vocabulary (often none)
    temperature: float

    @classmethod
    def build(cls, s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec: _ChunkSpec, dtypes=None) -> _Heads:
        if dtypes is None:
            device = s_w_VH.device.type
            autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            dtypes = (autocast or s_w_VH.dtype, autocast or t_w_VH.dtype)
        v = spec.vocab
        return cls(
            s_hidden_NH,
            s_w_VH[:v].to(dtypes[0]),
            t_hidden_NH,
            t_w_VH[:v].to(dtypes[1]),
            spec.chunk_size,
            s_w_VH[v:].to(dtypes[0]),
            spec.temperature,
        )

    @property
    def dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return self.s_w_VH.dtype, self.t_w_VH.dtype

    @property
    def softmax_dtype(self) -> torch.dtype:
        return torch.promote_types(self.s_w_VH.dtype, torch.float32)

    def chunks(self, n_rows: int):
        return (slice(start, start + self.chunk_size) for start in range(0, n_rows, self.chunk_size))

    def student_logits(self, rows: slice) -> torch.Tensor:
        return _logits(self.s_hidden_NH[rows], self.s_w_VH, self.softmax_dtype)

    def teacher_logits(self, rows: slice) -> torch.Tensor:
        return _logits(self.t_hidden_NH[rows], self.t_w_VH, self.softmax_dtype)

    def student_target_logits(
        self, rows: slice, s_logits_RV: torch.Tensor, target_R: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(raw logit of each row's target, log-sum-exp of the raw logits over the whole head), from the
        chunk's unscaled student logits; the log-sum-exp is None where the softmax's own equals it
        (temperature 1, no padding rows)."""
        vocab = s_logits_RV.shape[1]
        target_logit_R = s_logits_RV.gather(1, target_R.clamp(max=vocab - 1).unsqueeze(1)).squeeze(1)
        lse_R = None if self.temperature == 1.0 else _row_logsumexp(s_logits_RV)
        if self.s_w_pad_EH.shape[0]:
            pad_RE = _logits(self.s_hidden_NH[rows], self.s_w_pad_EH, self.softmax_dtype)
            pad_target_R = pad_RE.gather(1, (target_R - vocab).clamp(min=0).unsqueeze(1)).squeeze(1)
            target_logit_R = torch.where(target_R >= vocab, pad_target_R, target_logit_R)
            lse_R = torch.logaddexp(
                _row_logsumexp(s_logits_RV) if lse_R is None else lse_R, torch.logsumexp(pad_RE, dim=-1)
            )
        return target_logit_R, lse_R

    def accumulate_student_grads(self, rows, grad_z_RV, grad_h_NH, grad_w_VH) -> None:
        with torch.autocast(self.s_w_VH.device.type, enabled=False):
            if grad_h_NH is not None:
                grad_h_NH[rows] = (grad_z_RV @ self.s_w_VH).to(grad_h_NH.dtype)
            if grad_w_VH is not None:
                hidden_RH = self.s_hidden_NH[rows].to(grad_z_RV.dtype)
                if grad_z_RV.dtype == grad_w_VH.dtype:
                    grad_w_VH[: grad_z_RV.shape[1]].addmm_(grad_z_RV.T, hidden_RH)
                else:
                    grad_w_VH[: grad_z_RV.shape[1]] += grad_z_RV.T @ hidden_RH


def _logits(hidden_RH: torch.Tensor, weight_VH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Logits as a fresh `dtype` tensor the caller may overwrite; the matmul in the weight's dtype."""
    with torch.autocast(weight_VH.device.type, enabled=False):
        return F.linear(hidden_RH.to(weight_VH.dtype), weight_VH).to(dtype)


# Elementwise work runs a block of rows at a time, so exp() and product temporaries stay this many
# rows x V instead of chunk_size x V.
_ROW_BLOCK = 64


def _row_blocks(n_rows: int):
    return (slice(start, start + _ROW_BLOCK) for start in range(0, n_rows, _ROW_BLOCK))


def _row_logsumexp(logits_RV: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.logsumexp(logits_RV[b], dim=-1) for b in _row_blocks(logits_RV.shape[0])])


def _log_softmax_(logits_RV: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities computed in place, per-row log-sum-exp)."""
    if temperature != 1.0:
        logits_RV.div_(temperature)
    lse_R = _row_logsumexp(logits_RV)
    return logits_RV.sub_(lse_R.unsqueeze(1)), lse_R


def _chunk_forward(
    logp_s_RV: torch.Tensor, logp_t_RV: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence, student entropy) per row."""
    div, entropy = [], []
    for b in _row_blocks(logp_s_RV.shape[0]):
        div.append(_divergence_N(logp_s_RV[b], logp_t_RV[b], beta))
        entropy.append(-(logp_s_RV[b].exp() * logp_s_RV[b]).sum(-1))
    return torch.cat(div), torch.cat(entropy)


def _chunk_logits_grad_(
    logp_s_RV: torch.Tensor, logp_t_RV: torch.Tensor, div_R: torch.Tensor, beta: float
) -> torch.Tensor:
    """d divergence / d (temperature-scaled student logits) per row, written over logp_s_RV."""
    for b in _row_blocks(logp_s_RV.shape[0]):
        logp_s_RV[b] = _logits_grad(logp_s_RV[b], logp_t_RV[b], div_R[b], beta)
    return logp_s_RV


def _logits_grad(
    logp_s_RV: torch.Tensor, logp_t_RV: torch.Tensor, div_R: torch.Tensor, beta: float
) -> torch.Tensor:
    if beta == 1:  # d KL(p || q) / dz = p * (log p - log q - KL)
        return logp_s_RV.exp() * (logp_s_RV - logp_t_RV - div_R.unsqueeze(1))
    if beta == 0:  # d KL(q || p) / dz = p - q
        return logp_s_RV.exp() - logp_t_RV.exp()
    with torch.enable_grad():
        z_RV = logp_s_RV.detach().requires_grad_()  # log-probs are logits too: log_softmax(z) = z
        div = _divergence_N(F.log_softmax(z_RV, dim=-1), logp_t_RV, beta)
        (grad_z_RV,) = torch.autograd.grad(div.sum(), z_RV)
    return grad_z_RV


def _log_probs(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    dtype = torch.promote_types(logits_NV.dtype, torch.float32)
    return F.log_softmax(logits_NV.to(dtype) / temperature, dim=-1)


def _kl_N(logp_NV: torch.Tensor, logq_NV: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row from log-probabilities; finite as long as the logits were finite."""
    return (logp_NV.exp() * (logp_NV - logq_NV)).sum(-1)


def _divergence_N(logp_s_NV: torch.Tensor, logp_t_NV: torch.Tensor, beta: float) -> torch.Tensor:
    if beta == 0:
        return _kl_N(logp_t_NV, logp_s_NV)
    if beta == 1:
        return _kl_N(logp_s_NV, logp_t_NV)
    logp_m_NV = torch.logaddexp(logp_s_NV + math.log1p(-beta), logp_t_NV + math.log(beta))
    return beta * _kl_N(logp_t_NV, logp_m_NV) + (1 - beta) * _kl_N(logp_s_NV, logp_m_NV)


def _check_hparams(beta: float, temperature: float) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0 (1.0 leaves the logits as they are), got {temperature}")


def _shared_vocab_size(student_rows: int, teacher_rows: int, vocab_size: int | None) -> int:
    if vocab_size is None:
        if student_rows != teacher_rows:
            raise ValueError(
                f"the student head has {student_rows} rows and the teacher head {teacher_rows}; pass "
                "vocab_size=len(tokenizer) so both are sliced to the tokenizer's vocabulary"
            )
        return student_rows
    if not 1 <= vocab_size <= min(student_rows, teacher_rows):
        raise ValueError(
            f"vocab_size={vocab_size} must be between 1 and the smaller head's rows "
            f"(student {student_rows}, teacher {teacher_rows}); use len(tokenizer) of the shared tokenizer"
        )
    return vocab_size
