"""P2: the divergence stage at Qwen3's vocabulary, opdkit against TRL's chunked loss and against full logits.

    python -m bench.run --only P2,P2s,P2f --reps 5

From both models' final hidden states (2 x 1024 completion tokens, hidden size 1024 as Qwen3-0.6B;
the teacher here also has hidden size 1024) through both output projections (151,936 x 1024, random,
float32; the student's requires grad) to the student's gradient (its head weight and hidden states).
opdkit: `loss.chunked_divergence` with its default chunk sizes. Peers, each with beta 1.0 (reverse KL):
`trl-chunked`, TRL 1.16's own `DistillationTrainer` loss, `_chunked_divergence_loss` (it projects tiles of
4096 tokens x 32,768 vocabulary rows; on a CPU its torch fallback); `trl`, full student and teacher logits
fed to `GKDTrainer.generalized_jsd_loss`. Measured: peak RSS above the baseline taken once the inputs exist,
and the wall time of forward and backward. All three losses agree to float32 rounding.
"""

from __future__ import annotations

import time
from typing import Any

import torch

SIDES = ("opdkit", "trl-chunked", "trl")
BASELINE = "full logits + trl.experimental.gkd.GKDTrainer.generalized_jsd_loss (beta=1.0)"
CHUNKED_BASELINE = (
    "trl.trainer.distillation_trainer._chunked_divergence_loss (beta=1.0), TRL's DistillationTrainer loss"
)


def default_params(quick: bool = False) -> dict[str, Any]:
    if quick:
        return dict(batch=2, tokens=64, hidden=64, teacher_hidden=64, vocab=4096, seed=0)
    return dict(batch=2, tokens=1024, hidden=1024, teacher_hidden=1024, vocab=151_936, seed=0)


def inputs(p: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(student hidden BTH, student head VH, teacher hidden BTH, teacher head VH); the student's need grad."""
    gen = torch.Generator().manual_seed(p["seed"])
    s_hidden = torch.randn(p["batch"], p["tokens"], p["hidden"], generator=gen).requires_grad_()
    t_hidden = torch.randn(p["batch"], p["tokens"], p["teacher_hidden"], generator=gen)
    s_head = (0.02 * torch.randn(p["vocab"], p["hidden"], generator=gen)).requires_grad_()
    t_head = 0.02 * torch.randn(p["vocab"], p["teacher_hidden"], generator=gen)
    return s_hidden, s_head, t_hidden, t_head


def opdkit_loss(s_hidden, s_head, t_hidden, t_head) -> torch.Tensor:
    from opdkit.opd import loss

    out = loss.chunked_divergence(s_hidden.flatten(0, 1), s_head, t_hidden.flatten(0, 1), t_head, beta=1.0)
    return out.sum / s_hidden.shape[0] / s_hidden.shape[1]


def trl_loss(s_hidden, s_head, t_hidden, t_head) -> torch.Tensor:
    from trl.experimental.gkd import GKDTrainer

    s_logits = s_hidden @ s_head.T
    with torch.no_grad():
        t_logits = t_hidden @ t_head.T
    labels = torch.zeros(s_hidden.shape[:2], dtype=torch.long)  # every position is a completion token
    return GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels=labels, beta=1.0)


def trl_chunked_loss(s_hidden, s_head, t_hidden, t_head) -> torch.Tensor:
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    mask = torch.ones(s_hidden.shape[:2], dtype=torch.long)  # every position is a completion token
    loss, _entropy_sum, _n = _chunked_divergence_loss(s_hidden, t_hidden, s_head, t_head, mask, beta=1.0)
    return loss  # the mean over the completion tokens


LOSSES = {"opdkit": opdkit_loss, "trl-chunked": trl_chunked_loss, "trl": trl_loss}
IMPORTS = {
    "opdkit": "opdkit.opd.loss",
    "trl-chunked": "trl.trainer.distillation_trainer",
    "trl": "trl.experimental.gkd",
}


def measure(side: str, p: dict) -> dict[str, Any]:
    """Peak RSS above the inputs' baseline through forward and backward, and the loss it gave."""
    from bench.common import peak_bytes, reset_peak

    tensors = inputs(p)
    loss_fn = LOSSES[side]
    __import__(IMPORTS[side])  # imports are not the stage
    base = reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = loss_fn(*tensors)
    loss.backward()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = peak_bytes() - base
    return {
        "peak_gb": peak / 1e9,
        "wall_s": wall,
        "tokens_per_s": p["batch"] * p["tokens"] / wall,
        "cpu_s": cpu,  # both threads' CPU time: steadier than the wall time on a shared machine
        "loss": float(loss.detach()),
        "head_grad_norm": float(tensors[1].grad.norm()),
        "logits_gb": p["batch"] * p["tokens"] * p["vocab"] * 4 / 1e9,
    }
