"""The defended teacher (opdkit.opd.teachers.defended, issue 50): each defence's scores against a direct
computation on a hand-made row; the sampled-token loss against autograd; the attacker's loss on defended
scores against the full-logit computation; the honest user's cost; the setting's refusals; a defended 02
run's first update against the attacker's loss computed directly from the defended scores."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.config import ConfigError, load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.opd.callbacks import GradientDump
from opdkit.opd.loss import per_token_divergence
from opdkit.opd.teachers.defended import (
    Defence,
    DefendedTeacher,
    chunked_student_rows,
    completed_topk,
    defended,
    distribution_cost,
    honest_cost,
    renormalised_rows,
    sampled_rows,
    sampled_token_loss,
)
from opdkit.opd.teachers.topk import topk_divergence
from opdkit.settings import parse_defence

# One hand-made position over a vocabulary of 6: its logits, and the token the student wrote there.
LOGITS = [2.0, 1.0, 0.5, -1.0, 0.0, 3.0]
ACTUAL = 3


def direct_logp() -> list[float]:
    """log softmax of LOGITS, by hand."""
    lse = math.log(sum(math.exp(z) for z in LOGITS))
    return [z - lse for z in LOGITS]


def row() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([LOGITS]), torch.tensor([ACTUAL])


def test_topk_sends_the_k_best_and_the_scored_token():
    ids, logp = Defence.of("topk:2").serve(*row())
    want = direct_logp()
    assert ids.tolist() == [[5, 0, ACTUAL]]
    torch.testing.assert_close(logp, torch.tensor([[want[5], want[0], want[ACTUAL]]]))
    ids, _ = Defence.of("topk:2").serve(torch.tensor([LOGITS]), torch.tensor([0]))
    assert ids.tolist() == [[5, 0, -1]], "the scored token among the best: no extra slot"


def test_sampled_sends_the_scored_token_alone():
    got = Defence.of("sampled").serve(*row())
    torch.testing.assert_close(got, torch.tensor([direct_logp()[ACTUAL]]))


@pytest.mark.parametrize("decimals", [0, 1, 2])
def test_round_sends_every_log_probability_rounded(decimals):
    got = Defence.of(f"round:{decimals}").serve(*row())
    want = [round(v, decimals) for v in direct_logp()]
    torch.testing.assert_close(got, torch.tensor([want]), atol=1e-6, rtol=0)


def test_noise_adds_the_seeded_gaussian_to_every_log_probability():
    got = Defence.of("noise:0.5").serve(*row(), torch.Generator().manual_seed(7))
    noise = torch.randn((1, 6), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(got, torch.tensor([direct_logp()]) + 0.5 * noise)


def test_none_sends_the_distribution_itself():
    torch.testing.assert_close(Defence.of("none").serve(*row()), torch.tensor([direct_logp()]))


def test_sampled_token_loss_gradient_is_reverse_kl_s_in_expectation():
    """Against autograd on a hand-made row: the gradient of sg(log s - log t) * log s at the token y is
    (log s(y) - log t(y)) * d log s(y); over y drawn from s it is the gradient of KL(s || t)."""
    teacher_logp = torch.tensor(direct_logp())
    z = torch.tensor([0.3, -0.2, 1.0, 0.1, 0.0, 0.5], requires_grad=True)
    expected = torch.zeros(6)
    for y in range(6):
        logp = torch.log_softmax(z, -1)
        (grad,) = torch.autograd.grad(sampled_token_loss(logp[y : y + 1], teacher_logp[y : y + 1]).sum(), z)
        ratio = float((logp[y] - teacher_logp[y]).detach())
        direct = ratio * (torch.eye(6)[y] - logp.exp()).detach()  # d log s(y) / dz = onehot(y) - s
        torch.testing.assert_close(grad, direct)
        expected += logp.exp()[y].detach() * grad
    logp = torch.log_softmax(z, -1)
    (kl_grad,) = torch.autograd.grad((logp.exp() * (logp - teacher_logp)).sum(), z)
    torch.testing.assert_close(expected, kl_grad)


def student_rows(n: int = 5, h: int = 4, v: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    head = torch.randn(v + 2, h, generator=g, requires_grad=True)  # two padding rows beyond the vocabulary
    teacher = torch.randn(n, v, generator=g) * 2
    actual = torch.randint(0, v, (n,), generator=g)
    return hidden, head, teacher, actual


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("spec", ["round:1", "noise:0.5"])
def test_renormalised_loss_equals_the_exact_divergence_to_the_renormalised_scores(spec, beta):
    hidden, head, teacher, actual = student_rows()
    served = Defence.of(spec).serve(teacher, actual, torch.Generator().manual_seed(3))
    out = chunked_student_rows(
        hidden, head, renormalised_rows(beta), (served,), vocab_size=6, chunk_size=2, target_ids_N=actual
    )
    logits = hidden @ head[:6].T
    want = per_token_divergence(logits, torch.log_softmax(served, -1), beta)
    torch.testing.assert_close(out.per_token_N, want.detach())
    got_grads = torch.autograd.grad(out.sum, (hidden, head))
    want_grads = torch.autograd.grad(want.sum(), (hidden, head))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    full = torch.log_softmax(hidden @ head.T, -1)  # the target's log-prob over the whole head, as a sampler's
    torch.testing.assert_close(
        out.student_token_logprob_N, full.gather(1, actual[:, None]).squeeze(1).detach()
    )


def test_sampled_loss_from_states_equals_the_full_logit_computation():
    hidden, head, teacher, actual = student_rows()
    t_logp = Defence.of("sampled").serve(teacher, actual)
    out = chunked_student_rows(hidden, head, sampled_rows, (t_logp, actual), vocab_size=6, chunk_size=2)
    s_logp = torch.log_softmax(hidden @ head[:6].T, -1).gather(1, actual[:, None]).squeeze(1)
    want = ((s_logp - t_logp).detach() * s_logp).sum()
    torch.testing.assert_close(out.sum, (s_logp - t_logp).sum().detach(), msg="its value: the log-ratio")
    torch.testing.assert_close(out.per_token_N, (s_logp - t_logp).detach())
    for a, b in zip(torch.autograd.grad(out.sum, (hidden, head)), torch.autograd.grad(want, (hidden, head))):
        torch.testing.assert_close(a, b)


def test_honest_cost_on_a_hand_made_row():
    logits, actual = row()
    none = honest_cost(Defence.of("none"), logits, actual)
    assert none["kl_N"].item() == pytest.approx(0.0, abs=1e-6) and none["top1_N"].item() == 1.0
    assert honest_cost(Defence.of("sampled"), logits, actual) is None
    # top-2 (and the scored token): the other three share what is left evenly
    want = direct_logp()
    p = [math.exp(v) for v in want]
    rest = (1 - p[5] - p[0] - p[ACTUAL]) / 3
    q = [math.log(rest)] * 6
    for i in (5, 0, ACTUAL):
        q[i] = want[i]
    served = completed_topk(*Defence.of("topk:2").serve(logits, actual), 6)
    torch.testing.assert_close(served, torch.tensor([q]))
    kl = sum(pi * (lp - lq) for pi, lp, lq in zip(p, want, q))
    cost = honest_cost(Defence.of("topk:2"), logits, actual)
    assert cost["kl_N"].item() == pytest.approx(kl, rel=1e-5) and cost["top1_N"].item() == 1.0
    # rounded to 0 decimals: log-probs -1.17, -2.17, ... become -1, -2, ...; renormalised, as a client must
    rounded = [round(v) for v in want]
    lse = math.log(sum(math.exp(v) for v in rounded))
    kl0 = sum(pi * (lp - (r - lse)) for pi, lp, r in zip(p, want, rounded))
    cost = honest_cost(Defence.of("round:0"), logits, actual)
    assert cost["kl_N"].item() == pytest.approx(kl0, rel=1e-5) and cost["top1_N"].item() == 1.0


def test_top1_agreement_needs_the_teacher_s_best_alone_on_top():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tie = torch.log(torch.tensor([[0.45, 0.45, 0.1]]))
    other = torch.log(torch.tensor([[0.2, 0.7, 0.1]]))
    assert distribution_cost(logits, tie)["top1_N"].item() == 0.0
    assert distribution_cost(logits, other)["top1_N"].item() == 0.0
    assert distribution_cost(logits, torch.log_softmax(logits, -1))["top1_N"].item() == 1.0


def test_topk_defence_is_the_kit_s_topk_divergence():
    """The attacker against topk:K reads exactly what the kit's top-K path computes from a server's top-K."""
    hidden, head, teacher, actual = student_rows()
    ids, logp = Defence.of("topk:2").serve(teacher, actual)
    want = topk_divergence(hidden @ head[:6].T, ids, logp, beta=1.0)
    assert want.shape == (5,) and torch.isfinite(want).all()


@pytest.mark.parametrize(
    "spec,match",
    [
        ("top:20", "did you mean topk"),
        ("topk", "topk is written topk:K"),
        ("topk:0", "K must be a positive integer"),
        ("round:1.5", "D must be an integer >= 0"),
        ("noise:-1", "S must be a positive number"),
        ("sampled:2", "sampled is written sampled"),
    ],
)
def test_setting_refuses_bad_values_in_one_line(spec, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(WhiteboxConfig, "tiny", {"teacher_defence": spec})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "over,match",
    [
        ({"kl_temperature": 2.0}, "kl_temperature 1"),
        ({"teacher_server": "http://x:8000"}, "leave teacher_server and teachers empty"),
    ],
)
def test_setting_refuses_what_it_cannot_defend(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(WhiteboxConfig, "tiny", {"teacher_defence": "topk:5", **over})


def test_parse_defence_reads_every_kind():
    assert [parse_defence(s) for s in ("none", "topk:20", "sampled", "round:2", "noise:0.5")] == [
        ("none", None),
        ("topk", 20),
        ("sampled", None),
        ("round", 2),
        ("noise", 0.5),
    ]
    assert Defence.of("noise:0.5").spec == "noise:0.5" and Defence.of("topk:5").spec == "topk:5"


def test_none_leaves_the_module_as_it_is():
    module = torch.nn.Linear(2, 2)
    assert defended(module, "none", 0) is module
    assert isinstance(defended(module, "sampled", 0), DefendedTeacher)


def test_a_resume_with_another_defence_is_refused():
    teacher = DefendedTeacher(torch.nn.Linear(2, 2), "round:1")
    saved = teacher.fingerprint([1, 2])
    teacher.check_same(saved, teacher.fingerprint([1, 2]))
    with pytest.raises(ValueError, match="resume with the same defence"):
        DefendedTeacher(torch.nn.Linear(2, 2), "topk:5").check_same(saved, {"teacher_defence": "topk:5"})


def direct_defended_gradient(run_path, spec: str, seed: int) -> dict[str, torch.Tensor]:
    """The first step's gradient from scratch: both models' full logits over the saved rollouts, the
    teacher's defended by `spec` as the API sends them (noise drawn from a generator seeded by `seed`, as
    the run's), the attacker's loss on them computed on full logits, summed over the loss tokens and divided
    by their count."""
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    defence, generator = Defence.of(spec), torch.Generator().manual_seed(seed)
    from helpers import first_step_logits

    total, count = 0.0, 0
    for s_NV, t_NV, actual_N in first_step_logits(run_path, student, teacher):
        served = defence.serve(t_NV, actual_N, generator)
        if defence.kind == "topk":
            loss_N = topk_divergence(s_NV, *served, beta=1.0)
        elif defence.kind == "sampled":
            s_logp_N = torch.log_softmax(s_NV, -1).gather(1, actual_N[:, None]).squeeze(1)
            loss_N = (s_logp_N - served).detach() * s_logp_N
        else:
            loss_N = per_token_divergence(s_NV, torch.log_softmax(served, -1), beta=1.0)
        total, count = total + loss_N.sum(), count + int(actual_N.numel())
    (total / count).backward()
    return {n: p.grad for n, p in student.named_parameters()}


@pytest.mark.parametrize("spec", ["topk:5", "sampled", "round:1", "noise:0.5"])
def test_defended_run_s_first_update_is_the_attacker_s_loss_on_the_defended_scores(tmp_path, spec):
    from helpers import assert_grads_close, run_tiny

    dump = tmp_path / "grad.pt"
    run = run_tiny(
        tmp_path, "r", [GradientDump(str(dump))], per_device_train_batch_size=4, teacher_defence=spec
    )
    assert_grads_close(torch.load(dump), direct_defended_gradient(run.path, spec, seed=42))
    assert {r.get("teacher_defence") for r in run.read_jsonl() if "loss" in r} == {spec}
