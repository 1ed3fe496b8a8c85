"""GOLD's cross-tokenizer divergence over an `Alignment`: each group's merged distributions compared by the
sorted L1 (or the hybrid), the student's side one autograd node (`_StudentLoss`) whose backward pass
recomputes each chunk and writes its gradient in closed form (see `opdkit.opd.teachers.cross`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from opdkit.opd.teachers.cross.alignment import Alignment
from opdkit.opd.teachers.cross.settings import CrossTokenizerSettings, check_settings
from opdkit.opd.teachers.cross.sortedl1 import Buffers, l1_signs
from opdkit.opd.teachers.cross.tokenbytes import VocabMatch

EPS = 1e-8  # GOLD's floor on a merged token's probability and on the hybrid's matched probabilities


@dataclass
class CrossTokenizerOutput:
    """What `cross_tokenizer_divergence` returns for G groups."""

    sum: torch.Tensor  # scalar, differentiable: sum over groups of weight x group loss
    per_group_G: torch.Tensor  # detached loss of each group (its matched and unmatched parts weighted)
    matched_G: torch.Tensor | None = None  # hybrid: detached generalized JSD on the shared vocabulary
    unmatched_G: torch.Tensor | None = None  # hybrid: detached sorted L1 on the rest


@dataclass
class _Side:
    """One model's rows and head, its temperature and vocabulary width."""

    hidden: torch.Tensor
    head: torch.Tensor | None  # None: `hidden` rows are logits already
    temperature: float
    vocab: int

    @property
    def dtype(self) -> torch.dtype:
        return torch.promote_types((self.hidden if self.head is None else self.head).dtype, torch.float32)

    def logits(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' logits at this side's temperature, R x vocab: a new tensor (or `out`, R x vocab), free to
        be changed in place."""
        if self.head is None:
            source = self.hidden[:, : self.vocab]
            if out is not None and source.dtype == out.dtype:
                z = torch.index_select(source, 0, rows, out=out)
            else:
                z = source.index_select(0, rows).to(self.dtype)
        else:
            with torch.autocast(rows.device.type, enabled=False):
                z = F.linear(self.hidden.index_select(0, rows).to(self.head.dtype), self.head[: self.vocab])
            z = z.to(self.dtype)
        if self.temperature != 1.0:
            z.div_(self.temperature)
        return z


def cross_tokenizer_divergence(
    student_hidden_NH: torch.Tensor,
    student_head_VH: torch.Tensor | None,
    teacher_hidden_MH: torch.Tensor,
    teacher_head_WH: torch.Tensor | None,
    alignment: Alignment,
    settings: CrossTokenizerSettings,
    *,
    match: VocabMatch | None = None,
    beta: float = 1.0,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
    group_weights_G: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> CrossTokenizerOutput:
    """Sum over groups of the cross-tokenizer loss, from final hidden states and bias-free heads (or, with a
    head of None, from logits rows: `student_hidden_NH` is then N x V logits).

    Gradient reaches the student's rows and head; the teacher's are detached. `match` (from `VocabMatch.of`)
    is needed with `crosstok_hybrid`; `beta` is the hybrid's generalized JSD weight (0 forward KL, 1 reverse
    KL, GOLD's default 0.5). `*_vocab_size` slices padded heads to their tokenizers; the adaptive hybrid
    weight is |shared| / the teacher's vocabulary so sliced. `group_weights_G` weights each group's loss in
    `sum` (`alignment.row_mean_weights()` gives TRL's reduction); default 1.
    """
    check_settings(settings)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    for name, hidden, rows in (
        ("student_hidden_NH", student_hidden_NH, alignment.num_student_tokens),
        ("teacher_hidden_MH", teacher_hidden_MH, alignment.num_teacher_tokens),
    ):
        if hidden.dim() != 2 or hidden.shape[0] != rows:
            raise ValueError(
                f"{name} {tuple(hidden.shape)} must have one row per completion token of the alignment "
                f"({rows}); gather the rows of every completion token, trailing EOS included"
            )
    student = _Side(
        student_hidden_NH,
        student_head_VH,
        settings.crosstok_student_temperature,
        _width(student_hidden_NH, student_head_VH, student_vocab_size, "student"),
    )
    teacher = _Side(
        teacher_hidden_MH.detach(),
        None if teacher_head_WH is None else teacher_head_WH.detach(),
        settings.crosstok_teacher_temperature,
        _width(teacher_hidden_MH, teacher_head_WH, teacher_vocab_size, "teacher"),
    )
    hybrid = _hybrid_plan(settings, match, beta, student.vocab, teacher.vocab, student_hidden_NH.device)
    run = _Run(student, teacher, alignment.to(student_hidden_NH.device), hybrid, chunk_size)
    wants_grad = torch.is_grad_enabled() and (
        student.hidden.requires_grad or (student.head is not None and student.head.requires_grad)
    )
    if wants_grad:
        loss_G, matched_G, unmatched_G = _StudentLoss.apply(student.hidden, student.head, run)
    else:
        with torch.no_grad():
            loss_G, matched_G, unmatched_G = run.forward(keep=False)
    weights = torch.ones_like(loss_G) if group_weights_G is None else group_weights_G.to(loss_G)
    out = CrossTokenizerOutput(sum=(weights * loss_G).sum(), per_group_G=loss_G.detach())
    if hybrid is not None and len(loss_G):
        out.matched_G, out.unmatched_G = matched_G, unmatched_G
    return out


def _width(hidden: torch.Tensor, head: torch.Tensor | None, vocab_size: int | None, name: str) -> int:
    rows = hidden.shape[1] if head is None else head.shape[0]
    if vocab_size is None:
        return rows
    if not 1 <= vocab_size <= rows:
        raise ValueError(
            f"{name}_vocab_size={vocab_size} must be between 1 and the {name}'s {rows} logits; use "
            f"len(tokenizer) of the {name}'s tokenizer"
        )
    return vocab_size


@dataclass
class _Hybrid:
    beta: float
    matched_weight: float
    unmatched_weight: float
    s_ids_S: torch.Tensor
    t_ids_S: torch.Tensor
    s_unmatched_V: torch.Tensor  # 1.0 where the student's token has no teacher twin
    t_unmatched_W: torch.Tensor


def _hybrid_plan(settings, match, beta, s_vocab, t_vocab, device) -> _Hybrid | None:
    if not settings.crosstok_hybrid:
        return None
    if match is None:
        raise ValueError("crosstok_hybrid needs match=VocabMatch.of(student_tokenizer, teacher_tokenizer)")
    keep = (match.student_ids_S < s_vocab) & (match.teacher_ids_S < t_vocab)
    s_ids, t_ids = match.student_ids_S[keep].to(device), match.teacher_ids_S[keep].to(device)
    if settings.crosstok_hybrid_weights == "adaptive":
        matched = len(t_ids) / max(1, t_vocab)
        weights = (matched, 1.0 - matched)
    else:
        weights = (settings.crosstok_matched_weight, settings.crosstok_unmatched_weight)
    s_un, t_un = torch.ones(s_vocab, device=device), torch.ones(t_vocab, device=device)
    s_un[s_ids], t_un[t_ids] = 0.0, 0.0
    return _Hybrid(beta, *weights, s_ids, t_ids, s_un, t_un)


class _StudentLoss(torch.autograd.Function):
    """The loss of every group as one autograd node of the student's rows and head. The forward pass keeps,
    per chunk of groups, only what the backward pass cannot recompute cheaply (the sorted L1's signs,
    compactly); the backward pass recomputes each chunk's merged probabilities and writes their gradient in
    closed form (`_Run.backward`), so no graph over vocabulary-wide tensors is recorded."""

    @staticmethod
    def forward(ctx, hidden, head, run):
        ctx.run = run
        loss_G, matched_G, unmatched_G = run.forward(keep=True)
        ctx.mark_non_differentiable(matched_G, unmatched_G)
        return loss_G, matched_G, unmatched_G

    @staticmethod
    def backward(ctx, grad_G, _matched, _unmatched):
        want_hidden, want_head = ctx.needs_input_grad[:2]
        return (*ctx.run.backward(grad_G, want_hidden, want_head), None)


@dataclass
class _Run:
    """One call of `cross_tokenizer_divergence`: its forward pass, group chunk by group chunk, and the
    backward pass of the student's side.

    Merged probabilities of a group: m_v = softmax(z / T)_v exp(c), c the log of the scalar tokens' factor.
    For a group loss L with dL/dm_v = G_v (the sorted L1's sign s_v for ULD), with A = sum_v G_v m_v:
        dL/dz_j = (G_j m_j - softmax(z / T)_j A) / T = m_j (G_j - A exp(-c)) / T,    dL/dc = A,
    and c's gradient reaches the scalar rows through log p(token) = z_token / T - logsumexp(z / T)."""

    student: _Side
    teacher: _Side
    al: Alignment
    hybrid: _Hybrid | None
    chunk_size: int
    saved: list = field(default_factory=list)

    def chunks(self) -> list[slice]:
        step = self.chunk_size
        return [slice(s, s + step) for s in range(0, self.al.num_groups, step)]

    def forward(self, keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(loss, matched part, unmatched part) of every group; `keep`: save what the backward pass reads."""
        s, t, al, hybrid = self.student, self.teacher, self.al, self.hybrid
        buffers, device = Buffers(), s.hidden.device
        log_c_s_G, lp_s_Q, lse_s_Q = _scalar_factors(
            s, al.s_scalar_Q, al.s_scalar_token_Q, al.s_scalar_group_Q, self, buffers, "m_s"
        )
        log_c_t_G, *_ = _scalar_factors(
            t, al.t_scalar_Q, al.t_scalar_token_Q, al.t_scalar_group_Q, self, buffers, "m_t"
        )
        if keep:
            self.log_c_s_G, self.lp_s_Q, self.lse_s_Q = log_c_s_G, lp_s_Q, lse_s_Q
        parts = []
        for chunk in self.chunks():
            rows_s, rows_t = al.s_base_G[chunk], al.t_base_G[chunk]
            m_s = s.logits(rows_s, buffers("m_s", (len(rows_s), s.vocab), s.dtype, device))
            _merge_(m_s, log_c_s_G[chunk])
            m_t = t.logits(rows_t, buffers("m_t", (len(rows_t), t.vocab), t.dtype, device))
            _merge_(m_t, log_c_t_G[chunk])
            if hybrid is None:
                signs, part_s, part_t = l1_signs(m_s, m_t, buffers)
                loss = part_s - part_t
                parts.append((loss, loss[:0], loss[:0]))
                if keep:
                    self.saved.append((signs, part_s))
                continue
            matched = _matched_jsd(m_s[:, hybrid.s_ids_S], m_t[:, hybrid.t_ids_S], hybrid.beta)
            m_s.mul_(hybrid.s_unmatched_V), m_t.mul_(hybrid.t_unmatched_W)
            signs, part_s, part_t = l1_signs(m_s, m_t, buffers)
            unmatched = part_s - part_t
            parts.append(
                (hybrid.matched_weight * matched + hybrid.unmatched_weight * unmatched, matched, unmatched)
            )
            if keep:
                self.saved.append((signs, log_c_t_G[chunk]))
        if not parts:
            empty = torch.zeros(0, dtype=s.dtype, device=s.hidden.device)
            return empty, empty.clone(), empty.clone()
        return tuple(torch.cat(p) for p in zip(*parts))

    def backward(self, grad_G: torch.Tensor, want_hidden: bool, want_head: bool):
        s, t, al, hybrid = self.student, self.teacher, self.al, self.hybrid
        grad_hidden = torch.zeros_like(s.hidden) if want_hidden else None
        grad_head = torch.zeros_like(s.head) if want_head else None
        grad_G = grad_G.to(s.dtype)
        dc_G = torch.zeros_like(grad_G)
        buffers, device = Buffers(), s.hidden.device
        for chunk, saved in zip(self.chunks(), self.saved):
            rows, g_R, log_c_R = al.s_base_G[chunk], grad_G[chunk], self.log_c_s_G[chunk]
            m = _merge_(s.logits(rows, buffers("m_s", (len(rows), s.vocab), s.dtype, device)), log_c_R)
            out = buffers("sign_a", m.shape, m.dtype, device)
            if hybrid is None:
                signs, part_R = saved
                # m (s - A e^-c) g / T: the shift and the scale folded into the sign table.
                shift, scale = _share(part_R, log_c_R), g_R / s.temperature
                grad_z = signs.expand(m, shift, scale, out=out, buffers=buffers).mul_(m)
                dc_G[chunk] = g_R * part_R
            else:
                signs, log_c_t_R = saved
                with torch.no_grad():
                    rows_t = al.t_base_G[chunk]
                    m_t = t.logits(rows_t, buffers("m_t", (len(rows_t), t.vocab), t.dtype, device))
                    _merge_(m_t, log_c_t_R)
                with torch.enable_grad():
                    m_S = m[:, hybrid.s_ids_S].requires_grad_()
                    jsd = _matched_jsd(m_S, m_t[:, hybrid.t_ids_S], hybrid.beta)
                    (grad_S,) = torch.autograd.grad((jsd * g_R).sum() * hybrid.matched_weight, m_S)
                signs.expand(torch.mul(m, hybrid.s_unmatched_V, out=out), out=out, buffers=buffers)
                grad_m = out.mul_(hybrid.s_unmatched_V).mul_(hybrid.unmatched_weight * g_R.unsqueeze(1))
                grad_m.index_add_(1, hybrid.s_ids_S, grad_S)
                part_R = grad_m.mul_(m).sum(1)  # grad_m is now G m
                grad_z = grad_m.sub_(m.mul_(_share(part_R, log_c_R).unsqueeze(1)))
                if s.temperature != 1.0:
                    grad_z.div_(s.temperature)
                dc_G[chunk] = part_R
            _put(s, rows, grad_z, grad_hidden, grad_head)
        # The scalar rows: d log p(token) / dz = (onehot(token) - softmax(z / T)) / T; GOLD's floor at EPS
        # passes no gradient below it.
        d_Q = dc_G[al.s_scalar_group_Q] * (self.lp_s_Q.exp() >= EPS)
        for start in range(0, len(al.s_scalar_Q), self.chunk_size):
            part = slice(start, start + self.chunk_size)
            rows, d_R = al.s_scalar_Q[part], d_Q[part]
            z = s.logits(rows, buffers("m_s", (len(rows), s.vocab), s.dtype, device))
            p = z.sub_(self.lse_s_Q[part].unsqueeze(1)).exp_()
            grad_z = p.mul_(-d_R.unsqueeze(1))
            grad_z.scatter_add_(1, al.s_scalar_token_Q[part].unsqueeze(1), d_R.unsqueeze(1))
            if s.temperature != 1.0:
                grad_z.div_(s.temperature)
            _put(s, rows, grad_z, grad_hidden, grad_head)
        return grad_hidden, grad_head


def _put(side: _Side, rows, grad_z, grad_hidden, grad_head) -> None:
    """Adds the gradient of the rows' logits to the hidden states' and the head's."""
    if side.head is None:
        if grad_hidden is not None:
            grad_hidden[:, : side.vocab].index_add_(0, rows, grad_z.to(grad_hidden.dtype))
        return
    with torch.autocast(grad_z.device.type, enabled=False):
        grad_z = grad_z.to(side.head.dtype)
        if grad_hidden is not None:
            grad_hidden.index_add_(0, rows, (grad_z @ side.head[: side.vocab]).to(grad_hidden.dtype))
        if grad_head is not None:
            grad_head[: side.vocab].addmm_(grad_z.T, side.hidden.index_select(0, rows).to(side.head.dtype))


def _share(part_R: torch.Tensor, log_c_R: torch.Tensor) -> torch.Tensor:
    """part exp(-c) in float64 (|part| <= exp(c)); through logarithms where exp(-c) alone would overflow."""
    part, log_c = part_R.double(), log_c_R.double()
    share = part * torch.exp(-log_c)
    safe = (part.abs().log() - log_c).exp() * part.sign()
    return torch.where(share.isfinite(), share, safe).to(part_R.dtype)


def _scalar_factors(side: _Side, rows_Q, tokens_Q, groups_Q, run: _Run, buffers: Buffers, name: str):
    """Per group, the sum of log max(p(actual token), EPS) over its scalar rows (GOLD's clamped product); and
    each scalar row's log p(token) and log-normalizer (for the backward pass)."""
    lp, lse = [], []
    for start in range(0, len(rows_Q), run.chunk_size):
        part = slice(start, start + run.chunk_size)
        rows = rows_Q[part]
        z = side.logits(rows, buffers(name, (len(rows), side.vocab), side.dtype, side.hidden.device))
        z_token = z.gather(1, tokens_Q[part].unsqueeze(1)).squeeze(1)
        top = z.amax(1)
        lse.append(top + z.sub_(top.unsqueeze(1)).exp_().sum(1).log())
        lp.append(z_token - lse[-1])
    log_c_G = torch.zeros(run.al.num_groups, dtype=side.dtype, device=side.hidden.device)
    if not lp:
        return log_c_G, log_c_G[:0], log_c_G[:0]
    lp_Q, lse_Q = torch.cat(lp), torch.cat(lse)
    return log_c_G.index_add_(0, groups_Q, lp_Q.exp().clamp_min(EPS).log()), lp_Q, lse_Q


def _merge_(z_RV: torch.Tensor, log_c_R: torch.Tensor) -> torch.Tensor:
    """Turns tempered logits, in place, into merged probabilities softmax(z) exp(c); returns them. The same
    calls give the same values bit for bit (the backward pass recomputes them and reads their buckets).
    exp(z - max) times exp(c) / sum in float64 keeps the dtype's relative precision however small exp(c) is
    (exp(log_softmax + c) loses |log_softmax + c| ulps of it)."""
    top = z_RV.amax(1, keepdim=True)
    total = z_RV.sub_(top).exp_().sum(1, keepdim=True)
    return z_RV.mul_((log_c_R.double().unsqueeze(1) - total.double().log()).exp().to(z_RV.dtype))


def _matched_jsd(p_s_RS: torch.Tensor, p_t_RS: torch.Tensor, beta: float) -> torch.Tensor:
    """GOLD's generalized JSD on (unnormalised) merged probabilities floored at EPS, summed per row."""
    ls, lt = p_s_RS.clamp_min(EPS).log(), p_t_RS.clamp_min(EPS).log()
    if beta == 0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return (beta * lt.exp() * (lt - lm) + (1 - beta) * ls.exp() * (ls - lm)).sum(-1)
