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
  slices both heads to the tokenizer's vocabulary so padding rows never enter the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class DivergenceOutput:
    """What `chunked_divergence` returns for N completion tokens."""

    sum: torch.Tensor  # scalar, differentiable: per-token divergence summed over the N rows
    per_token_N: torch.Tensor  # detached, for logging
    student_entropy_N: torch.Tensor  # detached entropy of the student's temperature-scaled distribution


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
) -> DivergenceOutput:
    """Summed per-token divergence from final (post-norm) hidden states and bias-free lm_head weights.

    Peak memory is a handful (about 6) of chunk_size x V float32 temporaries, in the forward and the
    backward pass, instead of several N x V ones; the price is running both heads' matmuls again in
    the backward pass. Gradient reaches the student's hidden states and head weight; the teacher's inputs are detached.
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

    student_w_VH = student_head_weight_VH[:vocab]
    teacher_w_VH = teacher_head_weight_VH[:vocab].detach()
    teacher_hidden_NH = teacher_hidden_NH.detach()
    div_chunks, entropy_chunks = [], []
    # An empty batch still runs one empty chunk so the sum stays attached to the student's graph:
    # under DDP/FSDP every rank must run backward through the same parameters.
    for start in range(0, max(n_rows, 1), chunk_size):
        rows = slice(start, start + chunk_size)
        # Non-reentrant checkpoint keeps only the inputs (views of tensors that exist anyway) and
        # recomputes the chunk's logits when its gradient is needed, one chunk at a time.
        div_C, entropy_C = checkpoint(
            _chunk_divergence,
            student_hidden_NH[rows],
            student_w_VH,
            teacher_hidden_NH[rows],
            teacher_w_VH,
            beta,
            temperature,
            use_reentrant=False,
        )
        div_chunks.append(div_C)
        entropy_chunks.append(entropy_C)
    div_N = torch.cat(div_chunks)
    return DivergenceOutput(
        sum=div_N.sum(), per_token_N=div_N.detach(), student_entropy_N=torch.cat(entropy_chunks)
    )


def _chunk_divergence(
    student_hidden_CH: torch.Tensor,
    student_w_VH: torch.Tensor,
    teacher_hidden_CH: torch.Tensor,
    teacher_w_VH: torch.Tensor,
    beta: float,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The matmul runs in the weights' dtype, as the model's own lm_head would; the softmax math is
    # upcast by _log_probs. Upcasting the weights instead would copy the whole V x H head per chunk.
    logp_s_CV = _log_probs(F.linear(student_hidden_CH.to(student_w_VH.dtype), student_w_VH), temperature)
    with torch.no_grad():
        logp_t_CV = _log_probs(F.linear(teacher_hidden_CH.to(teacher_w_VH.dtype), teacher_w_VH), temperature)
        entropy_C = -(logp_s_CV.exp() * logp_s_CV).sum(-1)
    return _divergence_N(logp_s_CV, logp_t_CV, beta), entropy_C


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
