"""Tests for opdkit.memory.device: what a process holds, counted on its tensors against the config by hand,
and whether this host's torch copies the head per row in a CPU bf16 decoding step (torch's profiler)."""

from __future__ import annotations

import pytest
import torch
from helpers import SMALL

from opdkit import memory


def test_cpu_bf16_head_copies_is_what_this_host_allocates():
    """The plan's CPU head copies against what torch's profiler sees allocated by a bf16 linear of the last
    position of a (rows, tokens, hidden) batch, as the kit's decoding loop computes its logits: a head per
    row where oneDNN takes bf16 matmuls, only the logits where the BLAS bmm reads the expanded head."""
    from torch.profiler import ProfilerActivity, profile

    rows, hidden, vocab = 4, 64, 1000
    head = torch.randn(vocab, hidden, dtype=torch.bfloat16)
    last = torch.randn(rows, 3, hidden, dtype=torch.bfloat16)[:, -1:, :]
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.nn.functional.linear(last, head)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert (largest >= rows * vocab * hidden * 2) == memory.cpu_bf16_head_copies(), largest
    if not memory.cpu_bf16_head_copies():
        assert largest == rows * vocab * 2  # the logits alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_by_counts_the_tensors_a_process_holds(dtype):
    """issue 28: each rank's record of what it holds, against the config's count by hand (SMALL, tied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SMALL)).to(dtype)
    h, i, q, kv = 96, 200, 6 * 32, 2 * 32
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + 2 * 32  # projections, 2 norms, q/k norms
    hand = 1000 * h + 3 * layer + h  # the tied embedding, 3 layers, the final norm
    held = memory.held_by(model)
    size = 4 if dtype == torch.float32 else 2
    assert held == {
        "params": hand,
        "bytes": hand * size,
        "of_params": hand,
        "dtypes": [memory.dtype_name(dtype)],
        "devices": ["cpu"],
    }
    line = memory.held_line({"rank": 1, "world_size": 2, "models": {"student": held}})
    assert line.startswith(f"rank 1 of 2 holds student {hand:,} of {hand:,} params (")
