"""A teacher in this process: any frozen module that presents final hidden states (`base_model(...)
.last_hidden_state`) and an output head (`get_output_embeddings().weight`): a Hugging Face model, or
antidistillation's `ADSTeacher` (a kind of this one, where it lives), whose stacked states and head give its
ADS logits. The divergence is the
exact, chunked one over the whole vocabulary (`loss.chunked_divergence`).

Under FSDP the frozen teacher is sharded like the student (weights only: it has no gradients or optimizer
state), so its memory per process falls with the process count. Sharding moves each unit to the device as it
shards it, so a teacher loaded in host memory is never whole on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opdkit.opd.loss import DivergenceOutput, chunked_divergence
from opdkit.opd.teachers.base import DivergenceInputs, Teacher, check_head_covers, student_states
from opdkit.rollout.source import RolloutRecord
from opdkit.run import sharding

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


def student_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    t_hidden_NH: torch.Tensor,
    teacher_head_VH: torch.Tensor,
    **divergence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The student's part of the loss: its backbone over `fwd`, the final hidden states where
    `pred_BT` marks a predicting position, and `chunked_divergence` against the teacher's
    with the student's own head weight: (summed divergence, per-token divergence, student entropy,
    student log-probability of each `target_ids_N` token if given).

    Run it as the student's forward (`sharding.call_inside_forward`): under FSDP the head weight (tied
    to the embedding in Qwen3-0.6B) is whole only there. A tuple of tensors, not a dataclass, so that
    the wrapper finds the output it hooks the backward pass on.
    """
    s_hidden_NH, s_head_VH = student_states(student, fwd, pred_BT)
    # The backbone runs under the caller's autocast; the heads' matmuls in their weights' dtypes (the
    # float32 student under DDP, FSDP's bf16 compute copy under its mixed precision).
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out = chunked_divergence(s_hidden_NH, s_head_VH, t_hidden_NH, teacher_head_VH, **divergence)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N


@dataclass
class States:
    """A teacher's side of the exact divergence: its final hidden states where `pred_BT` marks, its head, and
    the kind's step sums this micro-batch adds (None: none)."""

    hidden_NH: torch.Tensor
    head_VH: torch.Tensor
    sums: torch.Tensor | None = None


class LocalTeacher(Teacher):
    """Final hidden states and head from a module in this process (`module`), sharded under FSDP."""

    name = "teacher"
    importance_weighted = True

    def __init__(self, module: torch.nn.Module):
        self.module = module.eval().requires_grad_(False)
        self.sharded = False

    def start(self, student, tokenizer, args) -> None:
        check_head_covers("teacher", self.module, tokenizer)

    def place(self, device, shard: bool) -> None:
        self.sharded = shard
        if shard:
            sharding.shard_frozen(self.module)
        else:
            self.module.to(device)

    def score(self, record: RolloutRecord, own, fwd: dict, pred_BT: torch.Tensor) -> States:
        """The final hidden states where `pred_BT` marks and the head weight, run as the teacher's forward."""
        with torch.no_grad():  # the backbone alone: no other layer's output is kept
            hidden_NH, head_VH = sharding.call_inside_forward(
                self.module, self.module, self._states, pred_BT, **fwd
            )
        return States(hidden_NH, head_VH)

    def _states(self, pred_BT: torch.Tensor, **fwd) -> tuple[torch.Tensor, torch.Tensor]:
        """Run as the teacher's forward, the only place a sharded teacher's head is whole. The divergence
        reads that head again in the student's backward (it recomputes each chunk's logits) after FSDP has
        freed the gathered weight, so a sharded teacher hands over a copy: one head per micro-batch, held
        until its backward, instead of a replicated teacher."""
        t_hidden_NH = self.module.base_model(**fwd).last_hidden_state[pred_BT]
        head_VH = self.module.get_output_embeddings().weight
        return t_hidden_NH, head_VH.detach().clone() if self.sharded else head_VH

    def student_divergence(self, student, fwd, pred_BT, part: States, given: DivergenceInputs):
        divergence = given.one_vocabulary()
        return student_divergence(student, fwd, pred_BT, part.hidden_NH, part.head_VH, **divergence)

    def output(self, parts: tuple, record: RolloutRecord, part: States):
        return DivergenceOutput(*parts[:4]), part.sums
