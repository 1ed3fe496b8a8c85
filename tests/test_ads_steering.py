"""What ADS steers with (opdkit.ads.steering): one direction per gradient kind, built once and the same Δ as a
direction made directly; asking for the other kind frees the first's copies; the gradients' norms; on a CPU
offloading moves nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_prompts

from opdkit.ads.direction import FiniteDifference, make_direction
from opdkit.ads.gradient import global_norm
from opdkit.ads.steering import Steering


@pytest.fixture
def steering(teacher, proxy, g) -> Steering:
    """The completion gradient and, as a second kind, a random one of the same shapes."""
    gen = torch.Generator().manual_seed(0)
    other = {n: 0.05 * torch.randn(p.shape, generator=gen) for n, p in proxy.named_parameters()}
    return Steering(teacher, proxy, {"completion": g, "answer": other}, "fd", 1e-2, torch.device("cpu"))


def test_a_direction_is_built_once_per_kind_and_steers_by_its_gradient(steering, proxy, tok):
    ids, mask = tiny_prompts(tok, 2)
    first = steering.direction("completion")
    assert isinstance(first, FiniteDifference) and steering.direction("completion") is first
    for kind in ("completion", "answer"):
        want = make_direction("fd", proxy, steering.grads[kind], 1e-2).start(ids, mask)
        torch.testing.assert_close(steering.direction(kind).start(ids, mask), want)
    assert list(steering.directions) == ["answer"]  # building the answer direction freed the completion's
    assert steering.direction("completion") is not first  # built again when asked again


def test_grad_norms_and_offload_on_a_cpu(steering, teacher):
    norms = steering.grad_norms()
    assert norms == {k: pytest.approx(global_norm(g)) for k, g in steering.grads.items()}
    assert norms["completion"] != pytest.approx(norms["answer"])
    direction = steering.direction("completion")
    steering.offload(True)
    assert steering.teacher is teacher and steering.direction("completion") is direction
    assert all(p.device.type == "cpu" for p in teacher.parameters())
    steering.offload(False)
    assert steering.direction("completion") is direction
