"""A teacher with another tokenizer (`CrossTokenizerTeacher`): it reads each micro-batch re-tokenized into its
own tokens (`inputs`, when the step's rollouts arrive: `retokenize.Retokenizer`), an inner kind that gives
final hidden states and a head scores those rows (in process, or served), and the student's side is GOLD's
cross-tokenizer loss (`student_cross_divergence`, over `divergence.cross_tokenizer_divergence`). The step's
loss is a mean over its groups, not its tokens (`loss_count`), and it never forms the student's full rows (no
entropy).

    parts = student_cross_divergence(student, fwd, pred_BT, t_hidden_MH, t_head_WH,
                                     own["crosstok_alignment"], retok, beta=..., chunk_size=...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from opdkit.models import eos_ids
from opdkit.opd.loss import DivergenceOutput
from opdkit.opd.teachers.base import DivergenceInputs, Teacher, student_states
from opdkit.opd.teachers.cross.alignment import Alignment
from opdkit.opd.teachers.cross.divergence import cross_tokenizer_divergence
from opdkit.opd.teachers.cross.retokenize import Retokenizer, teacher_forward_inputs
from opdkit.opd.teachers.local import LocalTeacher, States
from opdkit.rollout.source import RolloutRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


class CrossTokenizerTeacher(Teacher):
    """`inner` (a kind that gives states and a head: `local.LocalTeacher` or one of its kinds) reading the
    teacher tokenizer's rows of each micro-batch."""

    name = "cross-tokenizer teacher"
    gives_entropy = False

    def __init__(self, inner: LocalTeacher, student_tokenizer, teacher_tokenizer, settings):
        if inner.another_tokenizer_refusal:
            raise ValueError(inner.another_tokenizer_refusal)
        self.inner, self.module, self.tokenizer = inner, inner.module, teacher_tokenizer
        self.retokenizer = Retokenizer.of(student_tokenizer, teacher_tokenizer, settings)

    def start(self, student, tokenizer, args) -> None:
        self.inner.start(student, self.tokenizer, args)
        # A completion that ends at any of the student's stop tokens ends at the teacher's EOS.
        self.stop_ids = eos_ids(tokenizer, student)

    def place(self, device, shard: bool) -> None:
        self.inner.place(device, shard)

    def inputs(self, record: RolloutRecord) -> dict:
        """The teacher's tokens, its predicting rows and the alignment (`Retokenizer.prepare`; a multi-turn
        record's transcripts rendered by the teacher's own chat template: `prepare_transcripts`)."""
        if record.conversations is not None:
            return self.retokenizer.prepare_transcripts(
                record.input_ids_BT,
                record.attention_mask_BT,
                record.loss_mask_BT,
                self.stop_ids,
                record.conversations,
            )
        return self.retokenizer.prepare(
            record.input_ids_BT, record.attention_mask_BT, record.loss_mask_BT, self.stop_ids
        )

    def saved(self, own: dict) -> dict[str, torch.Tensor]:
        return {k: v for k, v in own.items() if isinstance(v, torch.Tensor)}

    def prepare(self, batches, step: int) -> None:
        self.inner.prepare_batches(
            [
                {
                    "input_ids": own["teacher_input_ids"],
                    "attention_mask": own["teacher_attention_mask"],
                    "pred_BT": own["teacher_pred_BT"],
                    "teacher_id": None,
                }
                for _, own in batches
            ],
            step,
        )

    def loss_count(self, record: RolloutRecord, own: dict) -> torch.Tensor:
        return own["crosstok_groups"]

    def score(self, record: RolloutRecord, own: dict, fwd: dict, pred_BT) -> tuple[States, Any]:
        """The inner kind's states over the teacher's own rows, and the alignment."""
        t_fwd, t_pred_BT = teacher_forward_inputs(own)
        return self.inner.score(record, None, t_fwd, t_pred_BT), own["crosstok_alignment"]

    def student_divergence(self, student, fwd, pred_BT, part, given: DivergenceInputs):
        states, alignment = part
        return student_cross_divergence(
            student,
            fwd,
            pred_BT,
            states.hidden_NH,
            states.head_VH,
            alignment,
            self.retokenizer,
            beta=given.beta,
            chunk_size=given.chunk_size,
            target_ids_N=given.target_ids_N,
            student_vocab_size=given.vocab_size,
            teacher_vocab_size=len(self.tokenizer),
        )

    def output(self, parts: tuple, record: RolloutRecord, part):
        div_sum, per_token_N, token_logp_N = parts
        states, _ = part
        no_entropy_N = torch.zeros_like(per_token_N)
        return DivergenceOutput(div_sum, per_token_N, no_entropy_N, token_logp_N), states.sums

    def new_sums(self, device):
        return self.inner.new_sums(device)

    def metrics(self, sums) -> dict:
        return self.inner.metrics(sums)

    def describe(self, name: str) -> str:
        return self.retokenizer.describe(name)


def student_cross_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    t_hidden_MH: torch.Tensor,
    t_head_WH: torch.Tensor,
    plan: Alignment,
    retokenizer: Retokenizer,
    *,
    beta: float,
    student_vocab_size: int,
    teacher_vocab_size: int,
    chunk_size: int,
    target_ids_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The student's part of the cross-tokenizer loss, run as its forward like `local.student_divergence`:
    (summed group losses, each group's loss on the student token that closes the group (0 elsewhere), the
    student's log-probability of each `target_ids_N` token if given)."""
    s_hidden_NH, s_head_VH = student_states(student, fwd, pred_BT)
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out = cross_tokenizer_divergence(
            s_hidden_NH,
            s_head_VH,
            t_hidden_MH,
            t_head_WH,
            plan,
            retokenizer.settings,
            match=retokenizer.match,
            beta=beta,
            student_vocab_size=student_vocab_size,
            teacher_vocab_size=teacher_vocab_size,
            chunk_size=chunk_size,
        )
        token_logp_N = None
        if target_ids_N is not None:
            token_logp_N = _token_logprobs(
                s_hidden_NH.detach(), s_head_VH.detach(), target_ids_N, student_vocab_size, chunk_size
            )
    al = plan.to(s_hidden_NH.device)
    last_G = al.s_base_G.clone()
    if len(al.s_scalar_Q):
        last_G = last_G.scatter_reduce(0, al.s_scalar_group_Q, al.s_scalar_Q, "amax")
    per_token_N = torch.zeros(s_hidden_NH.shape[0], dtype=out.per_group_G.dtype, device=s_hidden_NH.device)
    per_token_N[last_G] = out.per_group_G
    return out.sum, per_token_N, token_logp_N


@torch.no_grad()
def _token_logprobs(hidden_NH, head_VH, target_N, vocab: int, chunk_size: int) -> torch.Tensor:
    """The student's log-probability of each sampled token (the vLLM engine's gap check), chunk by chunk."""
    parts = []
    for h, t in zip(hidden_NH.split(chunk_size), target_N.split(chunk_size)):
        logits = F.linear(h.to(head_VH.dtype), head_VH[:vocab]).float()
        parts.append(logits.gather(1, t.unsqueeze(1)).squeeze(1) - logits.logsumexp(-1))
    return torch.cat(parts) if parts else hidden_NH.new_zeros(0)
