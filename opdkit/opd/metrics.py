"""A `DistillTrainer` step's metrics.jsonl columns: the step's sums kept on the device while it runs
(`StepStats`: no host read between forward and backward), read once when the step is logged, summed over
processes then (`Processes`).

    stats = StepStats(teacher_sums=teacher.new_sums(device))   # at the step's start
    stats.add_rollouts(record); stats.add_gap(gap_N)          # as its micro-batches go
    row, teacher_sums = step_columns(stats, logs, step=3, max_grad_norm=1.0, gives_entropy=True, procs=procs)
    row.update(async_columns(stats, procs))                   # rollouts sampled ahead only

The trainer adds the teacher kind's own columns (`Teacher.metrics`) and the rollout source's
(`RolloutSource.step_metrics`, e.g. multi-turn episodes' tool/* columns).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from opdkit.rollout.source import RolloutRecord

Number = float | torch.Tensor


@dataclass(frozen=True)
class Processes:
    """Reductions over the run's processes (`world_size`), each on `device`; identities in one process."""

    device: torch.device | str
    world_size: int

    def _reduce(self, t: torch.Tensor, op) -> torch.Tensor:
        t = t.to(self.device)
        if self.world_size > 1 and dist.is_initialized():
            t = t.clone()
            dist.all_reduce(t, op=op)
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, t: torch.Tensor) -> torch.Tensor:
        return self._reduce(t, dist.ReduceOp.MAX)


@dataclass
class StepStats:
    """One step's sums, device tensors where they come from the step's tensors (read when logged, summed
    across processes then)."""

    sequences: Number = 0.0
    completion_tokens: Number = 0.0  # loss tokens: the tokens the student sampled
    truncated: Number = 0.0
    entropy_sum: Number = 0.0
    gap_sum: Number = 0.0  # sum of |log p_sampler - log p_student| over the sampled tokens (where reported)
    gap_tokens: Number = 0.0
    teacher_sums: torch.Tensor | None = None  # the teacher kind's own (`Teacher.new_sums`)
    started: float = field(default_factory=time.time)
    # Rollouts sampled ahead: the step's staleness, and its importance ratios' sum, count, capped count
    # and maximum over this process's loss tokens.
    staleness: int | None = None
    ratios: torch.Tensor | None = None
    # Its first micro-batch's |log p_sampler - log p_version| summed, and its token count: against the
    # weights that sampled it (`guards.SamplerChecks.sampler_gap`).
    sampler_gap: torch.Tensor | None = None

    def add_rollouts(self, record: RolloutRecord) -> None:
        self.sequences += record.input_ids_BT.shape[0]
        self.completion_tokens += record.loss_mask_BT.sum()
        self.truncated += record.truncated_B.sum()

    def add_gap(self, gap_N: torch.Tensor) -> None:
        self.gap_sum += gap_N.sum()
        self.gap_tokens += gap_N.shape[0]

    def add_teacher_sums(self, sums: torch.Tensor) -> None:
        acc = self.teacher_sums
        self.teacher_sums = sums if acc is None else acc + sums.to(acc)

    def add_ratios(self, log_ratio_N: torch.Tensor, cap: float) -> None:
        ratio_N = log_ratio_N.detach().double().exp()
        now = torch.stack(
            [ratio_N.sum(), ratio_N.new_tensor(float(ratio_N.numel())), (ratio_N > cap).sum().double()]
        )
        top = ratio_N.max() if ratio_N.numel() else ratio_N.new_zeros(())
        if self.ratios is None:
            self.ratios = torch.cat([now, top[None]])
        else:
            self.ratios = torch.cat([self.ratios[:3] + now, torch.maximum(self.ratios[3], top)[None]])

    def as_tensor(self, device) -> torch.Tensor:
        vals = [
            self.sequences,
            self.completion_tokens,
            self.truncated,
            self.entropy_sum,
            self.gap_sum,
            self.gap_tokens,
        ]
        out = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in vals])
        if self.teacher_sums is None:
            return out
        return torch.cat([out, self.teacher_sums.to(device, torch.float64)])


def step_columns(
    stats: StepStats,
    logs: dict,
    step: int,
    max_grad_norm: float,
    gives_entropy: bool,
    procs: Processes,
) -> tuple[dict, list[float] | None]:
    """(the step's own columns, its teacher sums over all processes, for `Teacher.metrics`). `step`: the
    optimizer steps taken (metrics.jsonl's `step`, the step's number from 1); `logs`: `Trainer.log`'s."""
    sums = procs.sum(stats.as_tensor(procs.device))
    seqs, toks, trunc, ent, gap, gap_toks = sums[:6].tolist()
    teacher_sums = sums[6:].tolist() if stats.teacher_sums is not None else None
    elapsed = max(time.time() - stats.started, 1e-9)
    row = {
        "step": step,
        "loss": logs["loss"],
        "grad_norm": logs["grad_norm"],
        "clipped": bool(max_grad_norm and math.isfinite(max_grad_norm) and logs["grad_norm"] > max_grad_norm),
        "lr": logs.get("learning_rate"),
        "completion_length": toks / max(seqs, 1),
        "truncated_fraction": trunc / max(seqs, 1),
        "entropy": ent / max(toks, 1) if gives_entropy else None,
        "tokens_per_s": toks / elapsed,
        "completion_tokens": toks,
        # Mean |log p_engine - log p_student| of the sampled tokens: a stale or wrong weight sync shows here.
        "engine_logprob_gap": gap / gap_toks if gap_toks else None,
    }
    return row, teacher_sums


def async_columns(stats: StepStats, procs: Processes) -> dict:
    """Rollouts sampled ahead: the step's staleness (trainer step - the sampling weights' version) and its
    importance ratios pi_student / pi_sampler over the loss tokens: mean, maximum, share above the cap
    (capped where `async_correction` is truncated), and the engine's log-prob gap to the weights that
    sampled (first micro-batch), over all processes."""
    ratios = stats.ratios if stats.ratios is not None else torch.zeros(4, dtype=torch.float64)
    ratio_sum, tokens, capped = procs.sum(ratios[:3]).tolist()
    (top,) = procs.max(ratios[3:]).tolist()
    gap = stats.sampler_gap if stats.sampler_gap is not None else torch.zeros(2, dtype=torch.float64)
    gap_sum, gap_tokens = procs.sum(gap).tolist()
    return {
        "async/staleness": stats.staleness,
        "async/ratio_mean": ratio_sum / tokens if tokens else None,
        "async/ratio_max": top if tokens else None,
        "async/capped_share": capped / tokens if tokens else None,
        # against the weights that sampled the step's first micro-batch (`guards.SamplerChecks.sampler_gap`)
        "async/sampler_logprob_gap": gap_sum / gap_tokens if gap_tokens else None,
    }
