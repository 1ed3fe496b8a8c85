"""A teacher given as its top-K log-probabilities (`teacher_logprobs: topk:K`, `topk.TopKTeacher`): no head
and no hidden states here, so the loss is the approximate top-K divergence (`topk.chunked_topk_divergence`),
on the student's vocabulary, at temperature 1 (the served log-probabilities are at 1), labelled as
approximate beside the loss in metrics.jsonl.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opdkit.opd import topk
from opdkit.opd.teachers.base import LossSettings, PlanRow, Teacher
from opdkit.rollout.source import RolloutRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


def student_topk_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    t_ids_NK: torch.Tensor,
    t_logprobs_NK: torch.Tensor,
    **divergence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`local.student_divergence` against a teacher's top-K log-probabilities: the approximate divergence,
    from the student's own states and head."""
    s_hidden_NH = student.base_model(**fwd).last_hidden_state[pred_BT]
    s_head_VH = student.get_output_embeddings().weight
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out = topk.chunked_topk_divergence(s_hidden_NH, s_head_VH, t_ids_NK, t_logprobs_NK, **divergence)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N


class TopK(Teacher):
    """A `topk.TopKTeacher` module as a teacher kind."""

    exact = False
    another_tokenizer_refusal = (
        "teacher_logprobs topk needs a teacher with the student's tokenizer (the served ids are the "
        "student's vocabulary); use teacher_logprobs exact for a teacher with another one."
    )

    def __init__(self, module: topk.TopKTeacher):
        self.module = module.eval().requires_grad_(False)

    def start(self, student, tokenizer, args) -> None:
        if args.kl_temperature != 1.0:
            raise ValueError(topk.TEMPERATURE_REFUSAL.format(temperature=args.kl_temperature))
        if args.process_index == 0:
            print(f"teacher_logprobs {self.module.label}: the loss is APPROXIMATE", flush=True)

    def prepare_rows(self, rows: list[dict], step: int) -> None:
        if rows:
            self.module.prepare_step(rows)

    def score(self, record: RolloutRecord, rows, fwd: dict, pred_BT: torch.Tensor):
        """The teacher's top-K (ids, log-probabilities) at the predicting positions."""
        return self.module.sparse(fwd["input_ids"], fwd["attention_mask"], pred_BT)

    def student_divergence(self, student, fwd, pred_BT, part, loss: LossSettings):
        t_ids_NK, t_logp_NK = part
        return student_topk_divergence(student, fwd, pred_BT, t_ids_NK, t_logp_NK, **loss.one_vocabulary())

    def metrics(self, sums) -> dict:
        return {"teacher_logprobs": f"topk:{self.module.k} (approximate)"}

    def plan_rows(self) -> list[PlanRow]:
        """K + 1 (id, log-probability) entries per scored token: int64 and float32."""
        return [PlanRow("teacher top-K log-probabilities", 0, (self.module.k + 1) * (8 + 4))]
