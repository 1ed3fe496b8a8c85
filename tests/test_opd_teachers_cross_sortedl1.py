"""Tests for opdkit.opd.teachers.cross.sortedl1: the sorted L1 without sorting against a plain sort (ties,
zeros, values equal to 1e-4), and how few values it sorts at Qwen3's size."""

from __future__ import annotations

import pytest
import torch
from helpers import sorted_l1_reference

from opdkit.opd.teachers.cross import sorted_l1, sortedl1


def _cases(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for trial in range(40):
        v, w = (int(x) for x in torch.randint(1, 400, (2,), generator=gen))
        kind = trial % 5
        if kind == 0:  # softmaxes of different sharpness
            a = torch.softmax(3 * torch.randn(4, v, generator=gen, dtype=torch.float64), -1)
            b = torch.softmax(torch.randn(4, w, generator=gen, dtype=torch.float64), -1)
        elif kind == 1:  # ties and zeros
            a = torch.randint(0, 4, (4, v), generator=gen).double() / 4
            b = torch.randint(0, 4, (4, w), generator=gen).double() / 4
        elif kind == 2:  # the same values up to 1e-4: every rank's pair in one bucket
            base = torch.rand(4, max(v, w), generator=gen, dtype=torch.float64)
            a = base[:, :v] * (1 + 1e-4 * torch.rand(4, v, generator=gen, dtype=torch.float64))
            b = base[:, :w]
        elif kind == 3:  # one shape on both sides
            a = torch.softmax(2 * torch.randn(4, v, generator=gen), -1)
            b = torch.softmax(2 * torch.randn(4, w, generator=gen), -1)
        else:  # float32, scaled (merged groups)
            a = torch.rand(4, v, generator=gen) * 1e-3
            b = torch.rand(4, w, generator=gen) ** 4
        yield kind, a, b


@pytest.mark.parametrize(
    "dense, sort_all",
    [(4, 10**9), (10**9, 10**9), (4, 1)],
    ids=["dense-rows-sorted", "buckets-only", "small-vocabularies-sorted"],
)
def test_sorted_l1_equals_the_sort(monkeypatch, dense, sort_all):
    monkeypatch.setattr(sortedl1, "_DENSE", dense)
    monkeypatch.setattr(sortedl1, "_SORT_ALL", sort_all)
    for kind, a, b in _cases(0):
        a = a.clone().requires_grad_()
        got = sorted_l1(a, b)
        torch.testing.assert_close(got, sorted_l1_reference(a.detach(), b), rtol=1e-6, atol=1e-12)
        (grad,) = torch.autograd.grad(got.sum(), a)
        a_ref = a.detach().clone().requires_grad_()
        (grad_ref,) = torch.autograd.grad(sorted_l1_reference(a_ref, b).sum(), a_ref)
        if kind != 1:  # with ties the sort's order among equal values, and so its subgradient, is arbitrary
            torch.testing.assert_close(grad, grad_ref)


def test_sorted_l1_at_qwen3_size_sorts_few_values():
    gen = torch.Generator().manual_seed(1)
    a = torch.softmax(3 * torch.randn(3, 151_669, generator=gen), -1)
    b = torch.softmax(torch.randn(3, 129_280, generator=gen), -1)
    torch.testing.assert_close(sorted_l1(a, b), sorted_l1_reference(a, b), rtol=1e-5, atol=1e-7)
    keys_a, keys_b = sortedl1._float_keys(a), sortedl1._float_keys(b)
    top, low = int(max(keys_a.max(), keys_b.max())), int(min(keys_a.min(), keys_b.min()))
    ranked_a = sortedl1._Ranked.of(a, keys_a, top, top - low + 1)
    ranked_b = sortedl1._Ranked.of(b, keys_b, top, top - low + 1)
    first = ranked_a.cum_RK - ranked_a.count_RK + 1
    bucket = torch.arange(top - low + 1)
    met = (ranked_a.count_RK > 0) & (ranked_b.bucket_of_rank(first) <= bucket)
    met &= ranked_b.bucket_of_rank(ranked_a.cum_RK) >= bucket
    assert (met * ranked_a.count_RK).sum() < 0.05 * a.numel()  # a few percent of the values are sorted
