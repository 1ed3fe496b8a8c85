"""Math tests for opdkit.opd.loss: KL ends, TRL agreement, low temperature, gradients, chunking, memory."""

from __future__ import annotations

import pytest
import torch
from helpers import generalized_jsd
from torch.profiler import ProfilerActivity, profile

from opdkit.opd.loss import chunked_divergence, per_token_divergence

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _logits(
    *shape: int, scale: float = 3.0, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(dtype)


def _reference_N(
    student_NV: torch.Tensor, teacher_NV: torch.Tensor, beta: float, temperature: float
) -> torch.Tensor:
    """The definition in float64, in log space: at temperature 0.05 even float64 probabilities underflow."""
    logp_s = torch.log_softmax(student_NV.double() / temperature, dim=-1)
    logp_t = torch.log_softmax(teacher_NV.double() / temperature, dim=-1)

    def kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
        return (logp.exp() * (logp - logq)).sum(-1)

    if beta == 0:
        return kl(logp_t, logp_s)
    if beta == 1:
        return kl(logp_s, logp_t)
    weights = torch.tensor([1 - beta, beta], dtype=torch.float64).log()[:, None, None]
    logp_m = torch.logsumexp(torch.stack([logp_s, logp_t]) + weights, dim=0)
    return beta * kl(logp_t, logp_m) + (1 - beta) * kl(logp_s, logp_m)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_identical_inputs_give_zero(beta: float) -> None:
    logits_BTV = _logits(2, 4, 13)
    loss = generalized_jsd(logits_BTV, logits_BTV.clone(), beta=beta, temperature=0.7)
    assert abs(loss.item()) < 1e-6


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_ends_are_forward_and_reverse_kl(beta: float) -> None:
    student_BTV, teacher_BTV = _logits(2, 5, 11, seed=1), _logits(2, 5, 11, seed=2)
    mask_BT = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    p_s = torch.softmax(student_BTV.double(), dim=-1)[mask_BT]
    p_t = torch.softmax(teacher_BTV.double(), dim=-1)[mask_BT]
    if beta == 0:  # forward KL(teacher || student)
        expected = (p_t * (p_t.log() - p_s.log())).sum(-1).mean()
    else:  # reverse KL(student || teacher)
        expected = (p_s * (p_s.log() - p_t.log())).sum(-1).mean()
    loss = generalized_jsd(student_BTV, teacher_BTV, mask=mask_BT, beta=beta)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    # A 0/1 integer mask means the same as the bool one.
    torch.testing.assert_close(
        generalized_jsd(student_BTV, teacher_BTV, mask=mask_BT.long(), beta=beta), loss
    )


@pytest.fixture(scope="module")
def trl_generalized_jsd():
    gkd = pytest.importorskip("trl.experimental.gkd")
    return gkd.GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_trl(trl_generalized_jsd, beta: float, temperature: float) -> None:
    # TRL's "batchmean" with labels is jsd[labels != -100].sum() / (labels != -100).sum(): the mean over
    # unmasked tokens of the vocabulary-summed divergence, i.e. exactly our mean over masked tokens.
    student_BTV, teacher_BTV = _logits(3, 6, 17, seed=3), _logits(3, 6, 17, seed=4)
    labels_BT = torch.randint(0, 17, (3, 6), generator=torch.Generator().manual_seed(5))
    labels_BT[0, 4:] = -100
    labels_BT[2, 1:3] = -100
    expected = trl_generalized_jsd(
        student_BTV, teacher_BTV, labels=labels_BT, beta=beta, temperature=temperature, reduction="batchmean"
    )
    loss = generalized_jsd(
        student_BTV, teacher_BTV, mask=labels_BT != -100, beta=beta, temperature=temperature
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_low_temperature_with_large_logits(beta: float) -> None:
    # Logits ~30 at temperature 0.05 are ~600 apart after scaling: probabilities underflow, logs must not.
    student_NV = _logits(8, 50, scale=30.0, seed=6).requires_grad_()
    teacher_NV = _logits(8, 50, scale=30.0, seed=7)
    per_token_N = per_token_divergence(student_NV, teacher_NV, beta=beta, temperature=0.05)
    assert torch.isfinite(per_token_N).all()
    expected_N = _reference_N(student_NV.detach(), teacher_NV, beta, 0.05)
    torch.testing.assert_close(per_token_N.double(), expected_N, rtol=1e-4, atol=1e-4)
    per_token_N.sum().backward()
    assert torch.isfinite(student_NV.grad).all()


def test_bfloat16_logits_are_upcast() -> None:
    student_NV, teacher_NV = _logits(4, 9, dtype=torch.bfloat16), _logits(4, 9, seed=1, dtype=torch.bfloat16)
    per_token_N = per_token_divergence(student_NV, teacher_NV, beta=0.5)
    assert per_token_N.dtype == torch.float32
    torch.testing.assert_close(per_token_N.double(), _reference_N(student_NV, teacher_NV, 0.5, 1.0))


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradcheck(beta: float) -> None:
    student_BTV = _logits(2, 3, 5, seed=8, dtype=torch.float64).requires_grad_()
    teacher_BTV = _logits(2, 3, 5, seed=9, dtype=torch.float64)
    mask_BT = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda s: generalized_jsd(s, teacher_BTV, mask=mask_BT, beta=beta, temperature=0.8), (student_BTV,)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(teacher_logits=torch.zeros(2, 3, 6)), "same shape"),
        (dict(beta=1.5), "beta must be in"),
        (dict(beta=-0.1), "beta must be in"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(mask=torch.zeros(2, 3, dtype=torch.bool)), "selects no tokens"),
        (dict(mask=torch.ones(3, 2, dtype=torch.bool)), "mask"),
    ],
)
def test_generalized_jsd_errors(kwargs: dict, message: str) -> None:
    args = dict(student_logits=torch.zeros(2, 3, 5), teacher_logits=torch.zeros(2, 3, 5)) | kwargs
    with pytest.raises(ValueError, match=message):
        generalized_jsd(**args)


def _heads(n_rows: int = 7, vocab: int = 23, dtype: torch.dtype = torch.float64):
    """Student (H=6, 2 padding rows) and teacher (H=10, 5 different padding rows) hidden states and heads."""
    student_hidden_NH = _logits(n_rows, 6, scale=1.0, seed=10, dtype=dtype).requires_grad_()
    student_w_VH = _logits(vocab + 2, 6, scale=0.5, seed=11, dtype=dtype).requires_grad_()
    teacher_hidden_NH = _logits(n_rows, 10, scale=1.0, seed=12, dtype=dtype)
    teacher_w_VH = _logits(vocab + 5, 10, scale=0.5, seed=13, dtype=dtype).requires_grad_()
    # Huge padding logits would dominate the softmax if the slicing were missing.
    with torch.no_grad():
        teacher_w_VH[vocab:] = 50.0
    return student_hidden_NH, student_w_VH, teacher_hidden_NH, teacher_w_VH


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_matches_full_logits(chunk_size: int, beta: float) -> None:
    vocab, temperature = 23, 0.9
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = _heads(vocab=vocab)
    s_logits_NV = s_hidden_NH @ s_w_VH[:vocab].T
    t_logits_NV = t_hidden_NH @ t_w_VH[:vocab].T
    expected_N = per_token_divergence(s_logits_NV, t_logits_NV, beta=beta, temperature=temperature)
    grad_hidden_NH, grad_w_VH = torch.autograd.grad(expected_N.sum(), (s_hidden_NH, s_w_VH))

    out = chunked_divergence(
        s_hidden_NH,
        s_w_VH,
        t_hidden_NH,
        t_w_VH,
        beta=beta,
        temperature=temperature,
        vocab_size=vocab,
        chunk_size=chunk_size,
    )
    out.sum.backward()
    torch.testing.assert_close(out.sum, expected_N.sum())
    torch.testing.assert_close(out.per_token_N, expected_N.detach())
    assert not out.per_token_N.requires_grad and not out.student_entropy_N.requires_grad
    p_s_NV = torch.softmax(s_logits_NV.detach() / temperature, dim=-1)
    torch.testing.assert_close(out.student_entropy_N, -(p_s_NV * p_s_NV.log()).sum(-1))
    torch.testing.assert_close(s_hidden_NH.grad, grad_hidden_NH)
    torch.testing.assert_close(s_w_VH.grad, grad_w_VH)
    assert (s_w_VH.grad[vocab:] == 0).all()
    assert t_w_VH.grad is None


@pytest.mark.parametrize("vocab_chunk_size", [1, 5, 23])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
def test_vocabulary_chunks_give_the_full_logits_values_and_gradients(
    vocab_chunk_size: int, temperature: float, beta: float
) -> None:
    """However the vocabulary is cut (one row of it per tile, 5 rows with a ragged last tile, all of it), the
    divergence, entropy, sampler log-probabilities and both gradients are the full-logits ones: to 1e-12 in
    float64, to float32 rounding in float32."""
    vocab = 23
    for dtype, tol in (
        (torch.float64, dict(rtol=1e-12, atol=1e-12)),
        # float64 carries the claim; float32 only has to stay within its rounding, which the vocabulary
        # tiles' other summation order moves by up to ~1e-5 relative depending on the CPU's kernels
        # (1.5e-6 on a value of 0.14 on an AMD EPYC): 1e-4 and 1e-5 keep ten times that.
        (torch.float32, dict(rtol=1e-4, atol=1e-5)),
    ):
        s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = (
            t.detach().to(dtype).requires_grad_(t.requires_grad) for t in _heads(n_rows=9, vocab=vocab)
        )
        s_logits_NV = s_hidden_NH @ s_w_VH[:vocab].T
        expected_N = per_token_divergence(s_logits_NV, t_hidden_NH @ t_w_VH[:vocab].T, beta, temperature)
        grads = torch.autograd.grad(2.5 * expected_N.sum(), (s_hidden_NH, s_w_VH))
        target_N = torch.tensor([0, 4, 5, 22, 23, 24, 9, 10, 11])  # 23 and 24: the student's padding rows
        out = chunked_divergence(
            s_hidden_NH,
            s_w_VH,
            t_hidden_NH,
            t_w_VH,
            beta=beta,
            temperature=temperature,
            vocab_size=vocab,
            chunk_size=4,
            vocab_chunk_size=vocab_chunk_size,
            target_ids_N=target_N,
        )
        got = torch.autograd.grad(2.5 * out.sum, (s_hidden_NH, s_w_VH))
        torch.testing.assert_close(out.per_token_N, expected_N.detach(), **tol)
        p_s_NV = torch.softmax(s_logits_NV.detach() / temperature, dim=-1)
        torch.testing.assert_close(out.student_entropy_N, -(p_s_NV * p_s_NV.log()).sum(-1), **tol)
        logp_N = torch.log_softmax(s_hidden_NH @ s_w_VH.T, dim=-1).gather(1, target_N[:, None])[:, 0]
        torch.testing.assert_close(out.student_token_logprob_N, logp_N.detach(), **tol)
        for g, want in zip(got, grads):
            torch.testing.assert_close(g, want, **tol)


@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_matches_trls_chunked_loss(beta: float, temperature: float) -> None:
    """TRL's DistillationTrainer loss (`_chunked_divergence_loss`, its own tiles) gives the same mean
    divergence, entropy and student gradients."""
    trl_loss = pytest.importorskip("trl.trainer.distillation_trainer")._chunked_divergence_loss
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = (t.detach().float() for t in _heads(n_rows=11, vocab=23))
    s_hidden_NH, s_w_VH, t_w_VH = s_hidden_NH.requires_grad_(), s_w_VH[:23].requires_grad_(), t_w_VH[:23]
    loss, entropy_sum, n = trl_loss(
        s_hidden_NH[None], t_hidden_NH[None], s_w_VH, t_w_VH, torch.ones(1, 11), beta, temperature=temperature
    )
    want = torch.autograd.grad(loss, (s_hidden_NH, s_w_VH))
    out = chunked_divergence(
        s_hidden_NH,
        s_w_VH,
        t_hidden_NH,
        t_w_VH,
        beta=beta,
        temperature=temperature,
        chunk_size=4,
        vocab_chunk_size=6,
    )
    torch.testing.assert_close(out.sum / n, loss)
    torch.testing.assert_close(out.student_entropy_N.sum(), entropy_sum)
    for got, expected in zip(torch.autograd.grad(out.sum / n, (s_hidden_NH, s_w_VH)), want):
        torch.testing.assert_close(got, expected)


def test_chunked_peak_memory_is_the_head_gradient_and_a_few_tiles() -> None:
    """The logits never exist beyond a chunk of rows x a chunk of vocabulary per model: the peak is the
    head's gradient and a few such tiles, far below even one chunk of rows x the whole vocabulary."""
    n_rows, vocab, hidden, chunk, vocab_chunk = 512, 16384, 16, 256, 1024
    gen = torch.Generator().manual_seed(16)
    s_hidden_NH = torch.randn(n_rows, hidden, generator=gen).requires_grad_()
    s_w_VH = (0.1 * torch.randn(vocab, hidden, generator=gen)).requires_grad_()
    t_hidden_NH, t_w_VH = (
        torch.randn(n_rows, hidden, generator=gen),
        0.1 * torch.randn(vocab, hidden, generator=gen),
    )
    for beta in (0.0, 0.5, 1.0):
        s_hidden_NH.grad = s_w_VH.grad = None
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            chunked_divergence(
                s_hidden_NH,
                s_w_VH,
                t_hidden_NH,
                t_w_VH,
                beta=beta,
                chunk_size=chunk,
                vocab_chunk_size=vocab_chunk,
            ).sum.backward()
        records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for record in sorted(records, key=lambda e: e.start_ns()):
            live += record.nbytes()
            peak = max(peak, live)
        tile = chunk * vocab_chunk * 4
        assert peak < vocab * hidden * 4 + 5 * tile < chunk * vocab * 4, beta


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    "vocab", [23, 25]
)  # the student head's 2 last rows padding, or part of the vocabulary
def test_chunked_token_logprobs_are_a_samplers_and_leave_the_loss_alone(
    temperature: float, vocab: int
) -> None:
    """The student's log-probability of each target, read in the divergence's own pass, is what a sampler
    reports: log-softmax at temperature 1 over the whole head (padding rows included, targets there too);
    the divergence and its gradient are the same with and without targets."""
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = _heads(vocab=23)
    target_N = torch.tensor([0, 5, 22, 23, 24, 3, 11])
    kw = dict(beta=1.0, temperature=temperature, vocab_size=vocab, chunk_size=3)
    plain = chunked_divergence(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, **kw)
    grads = torch.autograd.grad(plain.sum, (s_hidden_NH, s_w_VH))
    out = chunked_divergence(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, **kw, target_ids_N=target_N)
    expected_N = torch.log_softmax(s_hidden_NH @ s_w_VH.T, dim=-1).gather(1, target_N[:, None])[:, 0]
    torch.testing.assert_close(out.student_token_logprob_N, expected_N.detach())
    assert plain.student_token_logprob_N is None and not out.student_token_logprob_N.requires_grad
    torch.testing.assert_close(out.per_token_N, plain.per_token_N, rtol=0, atol=0)
    for got, want in zip(torch.autograd.grad(out.sum, (s_hidden_NH, s_w_VH)), grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one token id per hidden row"):
        chunked_divergence(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, **kw, target_ids_N=target_N[:3])


def test_chunked_bfloat16_heads_use_float32_softmax() -> None:
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = (t.detach().bfloat16() for t in _heads(vocab=23))
    s_w_VH.requires_grad_()
    out = chunked_divergence(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, beta=0.5, vocab_size=23, chunk_size=4)
    assert out.sum.dtype == torch.float32
    expected_N = _reference_N(s_hidden_NH @ s_w_VH[:23].T, t_hidden_NH @ t_w_VH[:23].T, 0.5, 1.0)
    torch.testing.assert_close(out.per_token_N.double(), expected_N, rtol=1e-4, atol=1e-5)
    out.sum.backward()
    assert s_w_VH.grad.dtype == torch.bfloat16 and torch.isfinite(s_w_VH.grad.float()).all()


def test_chunked_empty_batch_stays_on_graph() -> None:
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = _heads(n_rows=0)
    out = chunked_divergence(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, vocab_size=23)
    assert out.sum.item() == 0 and out.per_token_N.shape == (0,)
    out.sum.backward()
    assert (s_w_VH.grad == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "pass vocab_size"),
        (dict(vocab_size=26), "vocab_size=26"),
        (dict(vocab_size=23, chunk_size=0), "chunk_size"),
        (dict(vocab_size=23, teacher_hidden_NH=torch.zeros(7, 6)), "teacher head weight"),
        (dict(vocab_size=23, teacher_hidden_NH=torch.zeros(5, 10)), "same N"),
    ],
)
def test_chunked_errors(kwargs: dict, message: str) -> None:
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = _heads()
    args = dict(
        student_hidden_NH=s_hidden_NH,
        student_head_weight_VH=s_w_VH,
        teacher_hidden_NH=t_hidden_NH,
        teacher_head_weight_VH=t_w_VH,
    )
    args |= kwargs
    with pytest.raises(ValueError, match=message):
        chunked_divergence(**args)


N_MEM, V_MEM, H_MEM, CHUNK_MEM = 256, 4096, 16, 16
LOGITS_BYTES = N_MEM * V_MEM * 4  # one float32 N x V tensor: 4 MiB


@pytest.fixture(scope="module")
def memory_inputs():
    gen = torch.Generator().manual_seed(14)
    s_hidden_NH = torch.randn(N_MEM, H_MEM, generator=gen).requires_grad_()
    s_w_VH = (0.1 * torch.randn(V_MEM, H_MEM, generator=gen)).requires_grad_()
    t_hidden_NH = torch.randn(N_MEM, H_MEM, generator=gen)
    t_w_VH = 0.1 * torch.randn(V_MEM, H_MEM, generator=gen)
    return s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH


def _naive_sum(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH) -> torch.Tensor:
    return per_token_divergence(s_hidden_NH @ s_w_VH.T, t_hidden_NH @ t_w_VH.T, beta=1.0).sum()


def _chunked_sum(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH) -> torch.Tensor:
    return chunked_divergence(s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, chunk_size=CHUNK_MEM).sum


def test_chunked_keeps_no_logits_for_backward(memory_inputs) -> None:
    """Bytes the autograd graph keeps between forward and backward, beyond the inputs themselves."""
    input_storages = {t.untyped_storage().data_ptr() for t in memory_inputs}

    def saved_bytes(loss_fn) -> int:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in input_storages:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(*memory_inputs)
        return sum(storages.values())

    assert saved_bytes(_naive_sum) >= 2 * LOGITS_BYTES
    assert saved_bytes(_chunked_sum) < LOGITS_BYTES / 64


def test_chunked_peak_memory_is_about_one_chunk(memory_inputs) -> None:
    """Peak of torch's CPU allocations over forward + backward, from the profiler's allocation records."""

    def peak_bytes(loss_fn) -> int:
        for t in memory_inputs:
            t.grad = None
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss_fn(*memory_inputs).backward()
        # The raw allocation records (the public per-op table folds allocations into ops).
        records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for record in sorted(records, key=lambda e: e.start_ns()):
            live += record.nbytes()  # negative for frees
            peak = max(peak, live)
        return peak

    # A chunk's working set is a handful of chunk x V float32 temporaries (logits, log-probs, products).
    chunk_logits_bytes = CHUNK_MEM * V_MEM * 4
    head_grad_bytes = V_MEM * H_MEM * 4
    naive, chunked = peak_bytes(_naive_sum), peak_bytes(_chunked_sum)
    assert naive >= 4 * LOGITS_BYTES
    assert chunked < 8 * chunk_logits_bytes + head_grad_bytes
    assert chunked < naive / 8


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_chunked_peak_memory_is_two_chunk_buffers(beta: float) -> None:
    """The backward pass turns a chunk's recomputed log-probs into the logits' gradient in place, and
    elementwise work runs on blocks of rows: about two chunk x V buffers plus the head's gradient,
    however many chunks there are."""
    n_rows, vocab, hidden, chunk = 1024, 4096, 16, 256
    gen = torch.Generator().manual_seed(15)
    s_hidden_NH = torch.randn(n_rows, hidden, generator=gen).requires_grad_()
    s_w_VH = (0.1 * torch.randn(vocab, hidden, generator=gen)).requires_grad_()
    t_hidden_NH, t_w_VH = (
        torch.randn(n_rows, hidden, generator=gen),
        0.1 * torch.randn(vocab, hidden, generator=gen),
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        chunked_divergence(
            s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, beta=beta, chunk_size=chunk
        ).sum.backward()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for record in sorted(records, key=lambda e: e.start_ns()):
        live += record.nbytes()
        peak = max(peak, live)
    assert peak < 3 * chunk * vocab * 4 + vocab * hidden * 4


def test_chunked_under_autocast_uses_bfloat16_matmuls_and_scales_with_the_upstream_gradient() -> None:
    s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH = (t.detach().float() for t in _heads(vocab=23))
    s_hidden_NH.requires_grad_()
    s_w_VH.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # What autograd gives for the same math on full logits, with F.linear under autocast.
        s_logits_NV = torch.nn.functional.linear(s_hidden_NH, s_w_VH[:23])
        t_logits_NV = torch.nn.functional.linear(t_hidden_NH, t_w_VH[:23])
        expected_N = per_token_divergence(s_logits_NV, t_logits_NV, beta=1.0, temperature=0.7)
        out = chunked_divergence(
            s_hidden_NH, s_w_VH, t_hidden_NH, t_w_VH, beta=1.0, temperature=0.7, vocab_size=23, chunk_size=3
        )
    assert s_logits_NV.dtype == torch.bfloat16
    grads = torch.autograd.grad(2.5 * expected_N.sum(), (s_hidden_NH, s_w_VH))
    (2.5 * out.sum).backward()
    torch.testing.assert_close(out.per_token_N, expected_N.detach())
    assert s_w_VH.grad.dtype == torch.float32
    torch.testing.assert_close(s_hidden_NH.grad, grads[0], rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(s_w_VH.grad, grads[1], rtol=2e-2, atol=1e-3)
