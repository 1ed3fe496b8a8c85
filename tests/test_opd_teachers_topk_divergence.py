"""The top-K divergence against a direct computation (the coarse-grained distributions built token by token),
its bound (never above the exact divergence; equal to it at K = V), the chunked form's gradient, and the
parsing of vLLM's prompt_logprobs."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import LogitsClient
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.opd.loss import per_token_divergence
from opdkit.opd.teachers import topk
from opdkit.opd.teachers.topk import teacher as topk_teacher
from opdkit.rollout.sampling import position_ids_from_mask
from opdkit.settings import parse_topk


def direct(student_logits_V, teacher_logits_V, support: list[int], beta: float) -> float:
    """The divergence between the two distributions coarse-grained onto `support` plus one bin for every
    other token, from plain Python sums."""
    p = torch.softmax(student_logits_V.double(), -1).tolist()
    q = torch.softmax(teacher_logits_V.double(), -1).tolist()
    rest = [i for i in range(len(p)) if i not in support]
    P = [p[i] for i in support] + ([sum(p[i] for i in rest)] if rest else [])
    Q = [q[i] for i in support] + ([sum(q[i] for i in rest)] if rest else [])

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)

    if beta == 0:
        return kl(Q, P)
    if beta == 1:
        return kl(P, Q)
    M = [(1 - beta) * x + beta * y for x, y in zip(P, Q)]
    return beta * kl(Q, M) + (1 - beta) * kl(P, M)


# The kit computes in float32 (served log-probabilities are float32), the references in float64. Its rounding
# is not one figure: log-softmax carries ~eps·|logit| per entry (logits here up to ~5), a bin made as a sum or
# a difference of probabilities loses more, and which exp/log kernels run depends on the CPU (AVX2 or
# AVX-512): measured errors reach 5e-6 relative on one x86 CPU and 1.03e-5 on another, so 1e-5 held on one and
# not the other. 1e-4 relative (~800 float32 eps), with 1e-6 absolute for near-zero divergences, is ten times
# the worst seen.
F32_RTOL, F32_ATOL = 1e-4, 1e-6


@pytest.fixture
def logits():
    """Logits whose smallest probabilities stay far above the teacher's tail floor."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 11, generator=g) * 1.5, torch.randn(6, 11, generator=g) * 1.5


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_the_topk_divergence_is_the_coarse_grained_one(logits, beta, k):
    s_NV, t_NV = logits
    actual_N = torch.tensor([0, 1, 2, 3, 4, 5])
    ids_NK, logp_NK = topk.teacher_topk(t_NV, k, actual_N)
    got_N = topk.topk_divergence(s_NV, ids_NK, logp_NK, beta=beta)
    for n in range(6):
        support = [i for i in ids_NK[n].tolist() if i >= 0]
        want = direct(s_NV[n], t_NV[n], support, beta)
        assert float(got_N[n]) == pytest.approx(want, rel=F32_RTOL, abs=F32_ATOL)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_it_never_exceeds_the_exact_divergence_and_equals_it_at_k_equal_v(logits, beta):
    s_NV, t_NV = logits
    exact_N = per_token_divergence(s_NV, t_NV, beta=beta)
    previous_N = torch.zeros(6)
    for k in range(1, 12):
        got_N = topk.topk_divergence(s_NV, *topk.teacher_topk(t_NV, k), beta=beta)
        assert (got_N <= exact_N * (1 + 1e-5) + 1e-7).all()
        assert (
            got_N >= previous_N * (1 - 1e-5) - 1e-7
        ).all()  # a finer partition loses less (nested supports)
        previous_N = got_N
    torch.testing.assert_close(got_N, exact_N, rtol=1e-5, atol=1e-6)


def test_a_teacher_tail_below_the_floor_is_taken_as_the_floor():
    t_1V = torch.tensor([[0.0, 0.0, -30.0]])  # the third token's mass ~5e-14: rounding noise once summed
    ids_NK, logp_NK = topk.teacher_topk(t_1V, 2)
    s_1V = torch.tensor([[0.0, 0.0, 0.0]])
    got = float(topk.topk_divergence(s_1V, ids_NK, logp_NK, beta=1.0))
    want = 2 / 3 * math.log((1 / 3) / 0.5) + 1 / 3 * math.log((1 / 3) / topk.TAIL_FLOOR)
    assert got == pytest.approx(want, rel=1e-4)


def test_at_k_equal_v_the_gradient_is_the_exact_one(logits):
    s_NV, t_NV = logits
    a_NV, b_NV = s_NV.clone().requires_grad_(), s_NV.clone().requires_grad_()
    topk.topk_divergence(a_NV, *topk.teacher_topk(t_NV, 11), beta=1.0).sum().backward()
    per_token_divergence(b_NV, t_NV, beta=1.0).sum().backward()
    torch.testing.assert_close(a_NV.grad, b_NV.grad, rtol=1e-5, atol=1e-6)


def test_the_chunked_form_gives_the_same_values_and_gradients():
    g = torch.Generator().manual_seed(1)
    h_NH = torch.randn(37, 16, generator=g).requires_grad_()
    w_VH = (torch.randn(13, 16, generator=g) * 0.5).requires_grad_()
    t_NV = torch.randn(37, 11, generator=g)
    ids_NK, logp_NK = topk.teacher_topk(t_NV, 4, torch.arange(37) % 11)
    out = topk.chunked_topk_divergence(h_NH, w_VH, ids_NK, logp_NK, beta=1.0, vocab_size=11, chunk_size=8)
    out.sum.backward()
    h2_NH, w2_VH = h_NH.detach().clone().requires_grad_(), w_VH.detach().clone().requires_grad_()
    want_N = topk.topk_divergence(h2_NH @ w2_VH[:11].T, ids_NK, logp_NK, beta=1.0)
    want_N.sum().backward()
    # both float32 (the chunks cast as the whole does), summed in another order: float32's floor above
    torch.testing.assert_close(out.per_token_N, want_N.detach(), rtol=F32_RTOL, atol=F32_ATOL)
    torch.testing.assert_close(h_NH.grad, h2_NH.grad, rtol=F32_RTOL, atol=F32_ATOL)
    torch.testing.assert_close(w_VH.grad, w2_VH.grad, rtol=F32_RTOL, atol=F32_ATOL)
    assert w_VH.grad[11:].abs().sum() == 0  # rows past the vocabulary get nothing
    p = torch.softmax(h2_NH.detach() @ w2_VH[:11].detach().T, -1)
    torch.testing.assert_close(out.student_entropy_N, -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-6)


def test_another_temperature_is_refused_and_specs_parse():
    s_NV = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="kl_temperature 1"):
        topk.topk_divergence(s_NV, *topk.teacher_topk(s_NV, 2), temperature=0.7)
    assert parse_topk("exact") is None and parse_topk("topk:20") == 20
    for bad in ("topk:0", "topk:x", "top20"):
        with pytest.raises(ValueError, match="topk:K"):
            parse_topk(bad)


def test_vllm_prompt_logprobs_are_laid_out_as_teacher_topk():
    """A /v1/completions choice as vLLM writes it (entry t: token t's distribution given those before it;
    ranks from 1; the actual token added where it is outside the top K) against `teacher_topk` of the same
    logits."""
    g = torch.Generator().manual_seed(2)
    row = [3, 1, 4, 1, 5]
    logits_TV = torch.randn(len(row), 9, generator=g)
    logp_TV = torch.log_softmax(logits_TV, -1)
    entries = [None]
    for t in range(1, len(row)):
        lp_V = logp_TV[t - 1]
        order = lp_V.argsort(descending=True).tolist()
        chosen = order[:2] + ([row[t]] if row[t] not in order[:2] else [])
        entries.append({str(i): {"logprob": float(lp_V[i]), "rank": order.index(i) + 1} for i in chosen})
    choice = json.loads(json.dumps({"prompt_logprobs": entries}))["prompt_logprobs"]
    ids_TK, lp_TK = topk_teacher._topk_row(choice, row, 2, "stub")
    want_ids, want_lp = topk.teacher_topk(logits_TV[:-1], 2, torch.tensor(row[1:]))
    assert torch.equal(ids_TK, want_ids)
    torch.testing.assert_close(lp_TK, want_lp)


def test_the_topk_teacher_gives_the_support_at_the_trainers_positions():
    """Left-padded rows: the sparse rows line up with `hidden[pred_BT]` of the padded batch."""
    model = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).eval()
    ids_BT = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 0]])
    attn_BT = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0]])
    pred_BT = torch.zeros_like(attn_BT, dtype=torch.bool)
    pred_BT[:, 3:6] = True  # prompt width 4: positions 3.. predict the completion
    pred_BT[1, 5] = False  # the second row's completion ends sooner
    ids_NK, logp_NK = topk.TopKTeacher(LogitsClient(model), 3).sparse(ids_BT, attn_BT, pred_BT)
    pos_BT = position_ids_from_mask(attn_BT)
    with torch.no_grad():
        logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT, position_ids=pos_BT).logits
    nxt_BT = torch.cat([ids_BT[:, 1:], ids_BT[:, :1]], 1)
    want_ids, want_logp = topk.teacher_topk(logits_BTV[pred_BT], 3, nxt_BT[pred_BT])
    assert torch.equal(ids_NK, want_ids)
    torch.testing.assert_close(logp_NK, want_logp, rtol=0, atol=1e-5)


def test_the_trainer_with_a_topk_teacher_computes_the_topk_divergence_and_refuses_another_temperature(
    tmp_path,
):
    """`DistillTrainer` given a `TopKTeacher` (here from the tiny teacher's own logits, no server): its loss
    on a left-padded micro-batch is `topk_divergence` of the student's logits at the completion positions
    over the completion tokens, below the exact one; kl_temperature != 1 is refused at construction."""
    from opdkit.models import load_tokenizer
    from opdkit.opd.arguments import OPDArguments
    from opdkit.opd.trainer import DistillTrainer
    from opdkit.rollout.source import RolloutRecord

    tok = load_tokenizer("tiny:student")
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).eval()
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    k = 4
    args = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no")
    trainer = DistillTrainer(
        model=student,
        args=OPDArguments(**args),
        processing_class=tok,
        teacher_model=topk.TopKTeacher(LogitsClient(teacher), k),
    )
    ids_BT = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 11, 0]])
    attn_BT = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0]])
    comp_BC = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # prompt width 4
    loss_BT = torch.cat([torch.zeros_like(comp_BC), comp_BC], 1)
    record = RolloutRecord(ids_BT, attn_BT, loss_BT, torch.zeros(2, dtype=torch.bool), [0, 1], [None] * 2)
    loss = float(trainer.compute_loss(trainer.model, trainer.micro_batch(record)).detach())
    want, exact, n = 0.0, 0.0, 0
    for b in range(2):
        row = ids_BT[b][attn_BT[b].bool()].tolist()
        first = int(attn_BT[b].nonzero()[0])
        at = [3 + j - first for j in range(4) if comp_BC[b, j]]
        with torch.no_grad():
            s_TV = student(input_ids=torch.tensor([row])).logits[0, at]
            t_TV = teacher(input_ids=torch.tensor([row])).logits[0, at]
        ids_TK, logp_TK = topk.teacher_topk(t_TV, k, torch.tensor(row[1:])[at])
        want += float(topk.topk_divergence(s_TV, ids_TK, logp_TK, beta=1.0).sum())
        exact += float(per_token_divergence(s_TV, t_TV, beta=1.0).sum())
        n += len(at)
    assert loss == pytest.approx(want / n, rel=1e-5) and loss < exact / n
    with pytest.raises(ValueError, match="kl_temperature=2.0"):
        DistillTrainer(
            model=student,
            args=OPDArguments(**args, kl_temperature=2.0),
            processing_class=tok,
            teacher_model=topk.TopKTeacher(LogitsClient(teacher), k),
        )
