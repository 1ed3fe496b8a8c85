"""A teacher with another tokenizer (`crossteacher.CrossTeacher`): it reads each micro-batch re-tokenized into
its own tokens (`rows`, when the step's rollouts arrive), an inner kind that gives final hidden states and a
head scores those rows (in process, or served), and the student's side is GOLD's cross-tokenizer loss
(`crossteacher.student_cross_divergence`). The step's loss is a mean over its groups, not its tokens
(`loss_count`), and it never forms the student's full rows (no entropy).
"""

from __future__ import annotations

from typing import Any

import torch

from opdkit.models import eos_ids
from opdkit.opd import crossteacher
from opdkit.opd.loss import DivergenceOutput
from opdkit.opd.teachers.base import LossSettings, PlanRow, Teacher
from opdkit.opd.teachers.local import LocalTeacher, States
from opdkit.rollout.source import RolloutRecord


class CrossTokenizerTeacher(Teacher):
    """`inner` (a kind that gives states and a head: `local.LocalTeacher` or one of its kinds) reading the
    teacher tokenizer's rows of each micro-batch."""

    gives_entropy = False

    def __init__(self, inner: LocalTeacher, student_tokenizer, teacher_tokenizer, settings):
        if inner.another_tokenizer_refusal:
            raise ValueError(inner.another_tokenizer_refusal)
        self.inner, self.module, self.tokenizer = inner, inner.module, teacher_tokenizer
        self.cross = crossteacher.CrossTeacher.of(student_tokenizer, teacher_tokenizer, settings)

    def start(self, student, tokenizer, args) -> None:
        self.inner.start(student, self.tokenizer, args)
        # A completion that ends at any of the student's stop tokens ends at the teacher's EOS.
        self.stop_ids = eos_ids(tokenizer, student)

    def place(self, device, shard: bool) -> None:
        self.inner.place(device, shard)

    def rows(self, record: RolloutRecord) -> dict:
        """The teacher's tokens, its predicting rows and the alignment (`crossteacher.CrossTeacher.prepare`;
        a multi-turn record's transcripts rendered by the teacher's own chat template:
        `prepare_transcripts`)."""
        if record.conversations is not None:
            return self.cross.prepare_transcripts(
                record.input_ids_BT,
                record.attention_mask_BT,
                record.loss_mask_BT,
                self.stop_ids,
                record.conversations,
            )
        return self.cross.prepare(
            record.input_ids_BT, record.attention_mask_BT, record.loss_mask_BT, self.stop_ids
        )

    def saved(self, rows: dict) -> dict[str, torch.Tensor]:
        return {k: v for k, v in rows.items() if isinstance(v, torch.Tensor)}

    def prepare(self, batches, step: int) -> None:
        self.inner.prepare_rows(
            [
                {
                    "input_ids": rows["teacher_input_ids"],
                    "attention_mask": rows["teacher_attention_mask"],
                    "pred_BT": rows["teacher_pred_BT"],
                    "teacher_id": None,
                }
                for _, rows in batches
            ],
            step,
        )

    def loss_count(self, record: RolloutRecord, rows: dict) -> torch.Tensor:
        return rows["crosstok_groups"]

    def score(self, record: RolloutRecord, rows: dict, fwd: dict, pred_BT) -> tuple[States, Any]:
        """The inner kind's states over the teacher's own rows, and the alignment."""
        t_fwd, t_pred_BT = crossteacher.teacher_forward_inputs(rows)
        return self.inner.score(record, None, t_fwd, t_pred_BT), rows["crosstok_alignment"]

    def student_divergence(self, student, fwd, pred_BT, part, loss: LossSettings):
        states, alignment = part
        return crossteacher.student_cross_divergence(
            student,
            fwd,
            pred_BT,
            states.hidden_NH,
            states.head_VH,
            alignment,
            self.cross,
            beta=loss.beta,
            chunk_size=loss.chunk_size,
            target_ids_N=loss.target_ids_N,
            student_vocab_size=loss.vocab_size,
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

    def plan_rows(self) -> list[PlanRow]:
        return self.inner.plan_rows()

    def describe(self, name: str) -> str:
        return self.cross.describe(name)
