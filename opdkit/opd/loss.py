"""The distillation loss: generalized Jensen-Shannon divergence between student and teacher tokens.

    per_token_N = per_token_divergence(student_logits_NV, teacher_logits_NV, beta=1.0)   # full logits
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
  (151,936 rows), and even one chunk of 1024 rows against the whole vocabulary is 0.62 GB per model, as
  much as the student head's own gradient; so `chunked_divergence` works from final hidden states one
  tile (a chunk of rows x a chunk of the vocabulary) at a time, combines each row's softmax from per-chunk
  log-sum-exps, and recomputes the tiles in the backward pass instead of keeping them;
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

# Vocabulary rows a chunk of hidden rows meets at once: with 1024 rows, a float32 tile is 16.8 MB.
VOCAB_CHUNK = 4096


@dataclass
class DivergenceOutput:
    """What `chunked_divergence` returns for N completion tokens."""

    sum: torch.Tensor  # scalar, differentiable: per-token divergence summed over the N rows
    per_token_N: torch.Tensor  # detached, for logging
    student_entropy_N: torch.Tensor  # detached entropy of the student's temperature-scaled distribution
    # Detached log-probability of each row's target token at temperature 1 over the student's whole head
    # (padding rows included, as a sampler's); None without `target_ids_N`.
    student_token_logprob_N: torch.Tensor | None = None


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
    vocab_chunk_size: int = VOCAB_CHUNK,
    target_ids_N: torch.Tensor | None = None,
    sampling_logprobs_N: torch.Tensor | None = None,
    ratio_cap: float = math.inf,
) -> DivergenceOutput:
    """Summed per-token divergence from final (post-norm) hidden states and bias-free lm_head weights.

    Both heads meet `chunk_size` rows at a time, `vocab_chunk_size` vocabulary rows at a time, so no logits
    exist beyond one such tile per model; peak memory is the student head's float32 gradient plus a few
    tiles, instead of several N x V tensors. The price is running both heads' matmuls again in the backward
    pass (and once more in the forward pass for 0 < beta < 1). Gradient reaches the student's hidden states
    and head weight; the teacher's inputs are detached. With `target_ids_N` (the token each row predicts)
    the output also carries the student's log-probability of it. With `sampling_logprobs_N` too (the
    sampler's log-probability of each target token, for rollouts sampled by older weights) each row's
    divergence enters the sum weighted by the truncated importance ratio
    w = min(exp(log p_student(target) - sampling), `ratio_cap`), detached: the gradient is
    sum_t w_t grad D_t, the divergence itself still the current student's against the teacher.
    """
    _check_hparams(beta, temperature)
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
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
    if sampling_logprobs_N is not None and (target_ids_N is None or sampling_logprobs_N.shape != (n_rows,)):
        raise ValueError(
            f"sampling_logprobs_N {tuple(sampling_logprobs_N.shape)} must hold one log-probability per "
            f"hidden row, ({n_rows},), with target_ids_N the tokens they are of"
        )
    div_N, entropy_N, token_logprob_N = _ChunkedDivergence.apply(
        student_hidden_NH,
        student_head_weight_VH,
        teacher_hidden_NH.detach(),
        teacher_head_weight_VH.detach(),
        _ChunkSpec(vocab, beta, temperature, chunk_size, vocab_chunk_size),
        target_ids_N,
    )
    # An empty batch still gives a sum attached to the student's graph (its gradient is zero): under
    # DDP/FSDP every rank must run backward through the same parameters.
    summed = div_N.sum()
    if sampling_logprobs_N is not None:
        log_ratio_N = token_logprob_N - sampling_logprobs_N.to(token_logprob_N)
        summed = (importance_weights(log_ratio_N, ratio_cap) * div_N).sum()
    return DivergenceOutput(
        sum=summed,
        per_token_N=div_N.detach(),
        student_entropy_N=entropy_N,
        student_token_logprob_N=None if target_ids_N is None else token_logprob_N,
    )


def importance_weights(log_ratio_N: torch.Tensor, cap: float) -> torch.Tensor:
    """The truncated importance weights min(exp(log_ratio), cap), detached (a weight, never a path for the
    gradient)."""
    return log_ratio_N.detach().exp().clamp(max=cap)


@dataclass(frozen=True)
class _ChunkSpec:
    vocab: int
    beta: float
    temperature: float
    chunk_size: int
    vocab_chunk_size: int


class _ChunkedDivergence(torch.autograd.Function):
    """Per-token divergence and student entropy from hidden states, one tile (chunk of rows x chunk of
    vocabulary) at a time, outside autocast (each head's matmul in the dtype autocast would have used).

    A row's softmax needs its whole vocabulary, so the forward pass keeps, per row and vocabulary chunk,
    each model's log-sum-exp over the chunk and the chunk-softmax-weighted means the divergence and
    entropy are made of; a row's log-sum-exp and divergence follow from those small (N x chunks) tables
    exactly, with no running rescaling. Mixed beta needs the row's log-sum-exps inside the log of the
    mixture, so it recomputes the tiles once more. The backward pass recomputes each tile, turns it into the
    gradient of the tile's logits in place (closed forms, with the per-row divergence the forward pass
    saved), and adds its products into float32 gradients of the student's hidden states and head.
    """

    @staticmethod
    def forward(ctx, s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec: _ChunkSpec, target_N=None):
        heads = _Heads.build(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec)
        with torch.autocast(s_w_VH.device.type, enabled=False):
            div_N, entropy_N, token_logprob_N, lse_s_N, lse_t_N, aux_N = _forward_pass(heads, target_N)
        ctx.save_for_backward(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, lse_s_N, lse_t_N, aux_N)
        ctx.spec, ctx.dtypes = spec, heads.dtypes
        ctx.mark_non_differentiable(entropy_N, token_logprob_N)
        return div_N, entropy_N, token_logprob_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_div_N, _grad_entropy_N, _grad_token_logprob_N):
        s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, lse_s_N, lse_t_N, aux_N = ctx.saved_tensors
        heads = _Heads.build(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, ctx.spec, ctx.dtypes)
        with torch.autocast(s_w_VH.device.type, enabled=False):
            grad_h_NH, grad_w_VH = _backward_pass(
                heads, grad_div_N, lse_s_N, lse_t_N, aux_N, *ctx.needs_input_grad[:2]
            )
        return grad_h_NH, grad_w_VH, None, None, None, None


def _forward_pass(heads: _Heads, target_N: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(divergence, student entropy, target log-probability (empty without targets), student lse, teacher
    lse, what the backward pass needs besides: the divergence, or KL(s || m) for mixed beta), per row."""
    spec, n_rows, f = heads.spec, heads.s_hidden_NH.shape[0], heads.softmax_dtype
    cols = heads.vocab_chunks()
    new = lambda k: heads.s_hidden_NH.new_empty(n_rows, k, dtype=f)  # noqa: E731
    # Per row and vocabulary chunk: log-sum-exps, E_s[z_s], the divergence's mean gap (`_tile_stats`).
    lse_s_NK, lse_t_NK, mean_zs_NK, gap_NK = new(len(cols)), new(len(cols)), new(len(cols)), new(len(cols))
    raw_lse = target_N is not None and (spec.temperature != 1.0 or heads.s_w_pad_EH.shape[0] > 0)
    raw_lse_NK = new(len(cols) if raw_lse else 0)
    target_logit_N = heads.s_hidden_NH.new_zeros(n_rows if target_N is not None else 0, dtype=f)
    for k, c in enumerate(cols):
        for r in heads.row_chunks(n_rows):
            zs_RC = heads.student_logits(r, c)
            if target_N is not None:
                _read_targets_(target_logit_N[r], zs_RC, target_N[r], c.start)
                if raw_lse:
                    raw_lse_NK[r, k] = torch.logsumexp(zs_RC, dim=-1)
            zt_RC = _scaled_(heads.teacher_logits(r, c), spec.temperature)
            stats = _tile_stats(_scaled_(zs_RC, spec.temperature), zt_RC, spec.beta)
            lse_s_NK[r, k], lse_t_NK[r, k], mean_zs_NK[r, k], gap_NK[r, k] = stats
            del zs_RC, zt_RC  # both tiles go before the next ones exist
    lse_s_N, lse_t_N = torch.logsumexp(lse_s_NK, dim=1), torch.logsumexp(lse_t_NK, dim=1)
    share_s_NK = (lse_s_NK - lse_s_N.unsqueeze(1)).exp_()  # each chunk's share of the row's mass
    entropy_N = lse_s_N - (share_s_NK * mean_zs_NK).sum(1)
    if spec.beta == 1:  # KL(s || t) = E_s[z_s - z_t] - lse_s + lse_t
        div_N = (share_s_NK * gap_NK).sum(1) - lse_s_N + lse_t_N
        aux_N = div_N
    elif spec.beta == 0:  # KL(t || s) = E_t[z_t - z_s] - lse_t + lse_s
        share_t_NK = (lse_t_NK - lse_t_N.unsqueeze(1)).exp_()
        div_N = (share_t_NK * gap_NK).sum(1) - lse_t_N + lse_s_N
        aux_N = div_N
    else:
        div_N, aux_N = _mixed_pass(heads, lse_s_N, lse_t_N)
    token_logprob_N = target_logit_N
    if target_N is not None:  # reads the targets among the padding rows first
        raw_lse_N = _student_raw_lse(heads, target_N, raw_lse_NK, lse_s_N, target_logit_N)
        token_logprob_N = target_logit_N - raw_lse_N
    return div_N, entropy_N, token_logprob_N, lse_s_N, lse_t_N, aux_N


def _backward_pass(heads: _Heads, grad_div_N, lse_s_N, lse_t_N, aux_N, want_h: bool, want_w: bool):
    """(gradient of the student's hidden states, of its head weight), each None when not wanted."""
    spec, f, mm_dtype = heads.spec, heads.softmax_dtype, heads.dtypes[0]
    s_hidden_NH = heads.s_hidden_NH
    # Sums over vocabulary chunks (and row chunks), so kept in (at least) float32 until the end; the head's
    # padding rows get an exact zero.
    grad_h_NH = torch.zeros_like(s_hidden_NH, dtype=f) if want_h else None
    rows_V = heads.s_w_VH.shape[0] + heads.s_w_pad_EH.shape[0]  # the whole head, padding rows included
    grad_w_VH = s_hidden_NH.new_zeros(rows_V, s_hidden_NH.shape[1], dtype=f) if want_w else None
    scale_N = grad_div_N.to(f) / spec.temperature
    for c in heads.vocab_chunks():
        s_w_CH = heads.s_w_VH[c].to(mm_dtype)
        for r in heads.row_chunks(s_hidden_NH.shape[0]):
            zs_RC = _scaled_(heads.student_logits(r, c), spec.temperature)
            zt_RC = _scaled_(heads.teacher_logits(r, c), spec.temperature)
            grad_z_RC = _logits_grad_(zs_RC, zt_RC, lse_s_N[r], lse_t_N[r], aux_N[r], spec.beta)
            del zt_RC
            grad_z_RC.mul_(scale_N[r].unsqueeze(1))
            if grad_h_NH is not None:
                _add_product_(grad_h_NH[r], grad_z_RC, s_w_CH)
            if grad_w_VH is not None:
                _add_product_(grad_w_VH[c], grad_z_RC.T, s_hidden_NH[r].to(mm_dtype))
            del grad_z_RC  # before the next tile's logits exist
    return (
        None if grad_h_NH is None else grad_h_NH.to(s_hidden_NH.dtype),
        None if grad_w_VH is None else grad_w_VH.to(heads.s_w_VH.dtype),
    )


@dataclass
class _Heads:
    """Both heads sliced to the shared vocabulary, the hidden rows they are applied to, and the matmul dtypes
    (autocast's, as `F.linear` would use, else each weight's own); a weight is cast one chunk at a time, so a
    float32 head under bfloat16 autocast never has a whole bfloat16 copy."""

    s_hidden_NH: torch.Tensor
    s_w_VH: torch.Tensor
    t_hidden_NH: torch.Tensor
    t_w_VH: torch.Tensor
    s_w_pad_EH: torch.Tensor  # the student head's rows beyond the shared vocabulary (often none)
    dtypes: tuple[torch.dtype, torch.dtype]
    spec: _ChunkSpec

    @classmethod
    def build(cls, s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, spec: _ChunkSpec, dtypes=None) -> _Heads:
        if dtypes is None:
            device = s_w_VH.device.type
            autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
            dtypes = (autocast or s_w_VH.dtype, autocast or t_w_VH.dtype)
        v = spec.vocab
        return cls(s_hidden_NH, s_w_VH[:v], t_hidden_NH, t_w_VH[:v], s_w_VH[v:], dtypes, spec)

    @property
    def softmax_dtype(self) -> torch.dtype:
        return torch.promote_types(self.dtypes[0], torch.float32)

    def vocab_chunks(self) -> list[slice]:
        step, v = self.spec.vocab_chunk_size, self.spec.vocab
        return [slice(start, min(start + step, v)) for start in range(0, v, step)]

    def row_chunks(self, n_rows: int):
        step = self.spec.chunk_size
        return (slice(start, start + step) for start in range(0, n_rows, step))

    def student_logits(self, rows: slice, cols: slice) -> torch.Tensor:
        return _logits(self.s_hidden_NH[rows], self.s_w_VH[cols], self.dtypes[0], self.softmax_dtype)

    def teacher_logits(self, rows: slice, cols: slice) -> torch.Tensor:
        return _logits(self.t_hidden_NH[rows], self.t_w_VH[cols], self.dtypes[1], self.softmax_dtype)

    def student_pad_logits(self, rows: slice) -> torch.Tensor:
        return _logits(self.s_hidden_NH[rows], self.s_w_pad_EH, self.dtypes[0], self.softmax_dtype)


def _logits(hidden_RH: torch.Tensor, weight_CH: torch.Tensor, mm_dtype, dtype) -> torch.Tensor:
    """Logits as a fresh `dtype` tensor the caller may overwrite; the matmul in `mm_dtype`."""
    return F.linear(hidden_RH.to(mm_dtype), weight_CH.to(mm_dtype)).to(dtype)


def _scaled_(logits_RC: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits_RC if temperature == 1.0 else logits_RC.div_(temperature)


def _tile_stats(zs_RC: torch.Tensor, zt_RC: torch.Tensor, beta: float) -> tuple[torch.Tensor, ...]:
    """Per row of one tile of temperature-scaled logits z_s, z_t, with E_s / E_t the means under the softmax
    over the tile's columns: (lse of z_s, lse of z_t, E_s[z_s], the divergence's mean gap: E_s[z_s - z_t]
    for beta 1, E_t[z_t - z_s] for beta 0, zero for mixed beta). Overwrites zt_RC; one tile-sized
    temporary, and few elementwise passes (on a CPU they cost about as much as the matmuls)."""
    max_s_R1 = zs_RC.amax(1, keepdim=True)
    e_RC = torch.sub(zs_RC, max_s_R1).exp_()
    sum_s_R = e_RC.sum(1)
    mean_zs_R = _row_dot(e_RC, zs_RC) / sum_s_R
    lse_s_R = max_s_R1.squeeze(1) + sum_s_R.log()
    max_t_R1 = zt_RC.amax(1, keepdim=True)
    if beta == 0:  # the teacher's weights take the temporary's place
        torch.sub(zt_RC, max_t_R1, out=e_RC).exp_()
        sum_t_R = e_RC.sum(1)
        gap_R = (_row_dot(e_RC, zt_RC) - _row_dot(e_RC, zs_RC)) / sum_t_R
        return lse_s_R, max_t_R1.squeeze(1) + sum_t_R.log(), mean_zs_R, gap_R
    gap_R = mean_zs_R - _row_dot(e_RC, zt_RC) / sum_s_R if beta == 1 else torch.zeros_like(lse_s_R)
    del e_RC
    lse_t_R = max_t_R1.squeeze(1) + zt_RC.sub_(max_t_R1).exp_().sum(1).log()
    return lse_s_R, lse_t_R, mean_zs_R, gap_R


def _row_dot(a_RC: torch.Tensor, b_RC: torch.Tensor) -> torch.Tensor:
    """Each row's dot product, without an R x C product in memory."""
    return torch.einsum("rc,rc->r", a_RC, b_RC)


def _mixed_pass(heads: _Heads, lse_s_N, lse_t_N) -> tuple[torch.Tensor, torch.Tensor]:
    """(generalized JSD, KL(p || m)) per row for 0 < beta < 1, m = (1 - beta) p + beta q: the tiles again,
    now normalised."""
    spec = heads.spec
    div_N, kl_sm_N = torch.zeros_like(lse_s_N), torch.zeros_like(lse_s_N)
    for c in heads.vocab_chunks():
        for r in heads.row_chunks(lse_s_N.shape[0]):
            logp_s_RC = _scaled_(heads.student_logits(r, c), spec.temperature).sub_(lse_s_N[r].unsqueeze(1))
            logp_t_RC = _scaled_(heads.teacher_logits(r, c), spec.temperature).sub_(lse_t_N[r].unsqueeze(1))
            kl_sm_R, kl_tm_R = _mixed_tile_(logp_s_RC, logp_t_RC, spec.beta)
            del logp_s_RC, logp_t_RC  # before the next tile's logits exist
            kl_sm_N[r] += kl_sm_R
            div_N[r] += spec.beta * kl_tm_R + (1 - spec.beta) * kl_sm_R
    return div_N, kl_sm_N


def _mixed_tile_(logp_s_RC, logp_t_RC, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This tile's shares of KL(p || m) and KL(q || m) per row, from normalised log-probabilities (both
    overwritten); two tile-sized temporaries."""
    log_a, log_b = math.log1p(-beta), math.log(beta)
    sm_RC, tm_RC = logp_s_RC + log_a, logp_t_RC.add_(log_b)  # log((1 - beta) p), log(beta q)
    logp_m_RC = torch.logaddexp(sm_RC, tm_RC)
    torch.sub(logp_s_RC, logp_m_RC, out=sm_RC)  # log p - log m
    tm_RC.sub_(logp_m_RC).sub_(log_b)  # log q - log m
    q_RC = logp_m_RC.add_(tm_RC).exp_()
    return _row_dot(logp_s_RC.exp_(), sm_RC), _row_dot(q_RC, tm_RC)


def _logits_grad_(zs_RC, zt_RC, lse_s_R, lse_t_R, aux_R, beta: float) -> torch.Tensor:
    """d divergence / d z_s of one tile of temperature-scaled logits z_s, z_t, written over zs_RC (p, q the
    student's and teacher's softmax, m = (1 - beta) p + beta q; aux: the row's KL(p || q) for beta 1,
    KL(p || m) for mixed beta). Overwrites zt_RC too."""
    if beta == 1:  # d KL(p || q) / dz = p * (log p - log q - KL(p || q))
        gap_RC = torch.sub(zs_RC, zt_RC, out=zt_RC).sub_((lse_s_R - lse_t_R + aux_R).unsqueeze(1))
        return zs_RC.sub_(lse_s_R.unsqueeze(1)).exp_().mul_(gap_RC)
    logp_s_RC = zs_RC.sub_(lse_s_R.unsqueeze(1))
    logp_t_RC = zt_RC.sub_(lse_t_R.unsqueeze(1))
    if beta == 0:  # d KL(q || p) / dz = p - q
        return logp_s_RC.exp_().sub_(logp_t_RC.exp_())
    # d JSD / dz = (1 - beta) * p * (log p - log m - KL(p || m))
    logp_m_RC = torch.logaddexp(logp_s_RC + math.log1p(-beta), logp_t_RC.add_(math.log(beta)))
    gap_RC = logp_m_RC.neg_().add_(logp_s_RC).sub_(aux_R.unsqueeze(1))
    return logp_s_RC.exp_().mul_(gap_RC).mul_(1 - beta)


def _add_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc in float32 (or wider), both factors in b's dtype (the matmul dtype, as autograd
    through F.linear would have them); a half-precision product is summed without being rounded first:
    CUDA computes it with a float32 output, other devices from the factors converted to float32."""
    a = a.to(b.dtype)
    if b.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _read_targets_(target_logit_R, zs_RC, target_R, start: int) -> None:
    """Copy each row's raw logit of its target into target_logit_R where the target is in this chunk."""
    width = zs_RC.shape[1]
    inside_R = (target_R >= start) & (target_R < start + width)
    picked_R = zs_RC.gather(1, (target_R - start).clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    target_logit_R.copy_(torch.where(inside_R, picked_R, target_logit_R))


def _student_raw_lse(heads: _Heads, target_N, raw_lse_NK, lse_s_N, target_logit_N) -> torch.Tensor:
    """Log-sum-exp of the student's raw logits over its whole head (padding rows included), as a sampler
    normalises; reads the targets that fall in the padding rows into target_logit_N."""
    if raw_lse_NK.shape[1] == 0:  # temperature 1, no padding rows: the softmax's own
        return lse_s_N
    raw_lse_N = torch.logsumexp(raw_lse_NK, dim=1)
    if heads.s_w_pad_EH.shape[0]:
        for r in heads.row_chunks(target_N.shape[0]):
            pad_RE = heads.student_pad_logits(r)
            _read_targets_(target_logit_N[r], pad_RE, target_N[r], heads.spec.vocab)
            raw_lse_N[r] = torch.logaddexp(raw_lse_N[r], torch.logsumexp(pad_RE, dim=-1))
    return raw_lse_N


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
