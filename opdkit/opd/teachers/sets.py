"""Several teachers (`mixture`): each row scored by the teacher its `teacher_id` names (`Routed`, one stacked
teacher to the loss: `mixture.RoutedTeacher`) or every row by all of them (`Weighted`: sum_k w_k D_k,
`mixture.WeightedTeachers`). Each teacher's divergence is logged as divergence/<id>; the set is
fingerprinted when a run starts and checked when it resumes (another set: one `mixture.TeacherSetMismatch`
line, before any step). Every teacher of a set reads the student's tokens (each is compared logit by logit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opdkit.opd import mixture, served
from opdkit.opd.teachers.base import LossSettings, PlanRow, Teacher, check_rows, head_rows
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.rollout.source import RolloutRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


def student_weighted_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    teachers: list[tuple[float, torch.Tensor, torch.Tensor]],
    **divergence,
) -> tuple[torch.Tensor, ...]:
    """`local.student_divergence` against several teachers at once: sum_k w_k D_k
    (`mixture.weighted_divergence`), then each teacher's own per-token divergence, stacked (K, N), to log."""
    s_hidden_NH = student.base_model(**fwd).last_hidden_state[pred_BT]
    s_head_VH = student.get_output_embeddings().weight
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out, each = mixture.weighted_divergence(s_hidden_NH, s_head_VH, teachers, **divergence)
    each_KN = torch.stack(each)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N, each_KN


REFUSAL = (
    "several teachers need the student's tokenizer (each is compared logit by logit); a teacher with another "
    "tokenizer can only be the one teacher of a run."
)


class _TeacherSet:
    """What both set kinds share: the ids, the per-teacher sums and columns, the fingerprint."""

    another_tokenizer_refusal = REFUSAL

    def _init_set(self, module) -> None:
        self.members = dict(module.teachers.items())
        self.ids = list(self.members)

    def new_sums(self, device) -> torch.Tensor:
        """Each teacher's summed per-token divergence, then its token count."""
        return torch.zeros(2 * len(self.ids), device=device)

    @staticmethod
    def _sums(sums_K: torch.Tensor, tokens_K: torch.Tensor) -> torch.Tensor:
        return torch.cat([sums_K.detach(), tokens_K])

    def metrics(self, sums: list[float] | None) -> dict:
        k = len(self.ids)
        sums = sums if sums is not None else [0.0] * (2 * k)
        return {f"divergence/{t}": d / n if n else None for t, d, n in zip(self.ids, sums[:k], sums[k:])}

    def fingerprint(self, probe_ids: list[int]) -> dict:
        return mixture.fingerprints(self.members, probe_ids)

    def check_same(self, saved: dict, now: dict) -> None:
        mixture.check_same_teachers(saved, now, self.tolerance)

    def _set_tolerance(self, args) -> None:
        dtypes = [getattr(t, "served_dtype", "float32") for t in self.members.values()]
        dtypes += ["bfloat16"] if args.bf16 else []
        self.tolerance = max(served.FINGERPRINT_TOLERANCE.get(d, 0.1) for d in dtypes)


class Routed(_TeacherSet, LocalTeacher):
    """A `mixture.RoutedTeacher` as a teacher kind: its stacked states and head, as one teacher in process."""

    name = "routed teachers"

    def __init__(self, module: mixture.RoutedTeacher):
        super().__init__(module)
        self._init_set(module)

    def start(self, student, tokenizer, args) -> None:
        super().start(student, tokenizer, args)
        self._set_tolerance(args)

    def place(self, device, shard: bool) -> None:
        self.module.to(device)

    def prepare_rows(self, rows: list[dict], step: int) -> None:
        if rows:
            self.module.prepare_step(rows)

    def output(self, parts: tuple, record: RolloutRecord, part):
        out, _ = super().output(parts, record, part)
        if record.teacher_ids is None:
            return out, None
        # each token's divergence is its row's teacher's
        device = record.input_ids_BT.device
        owner_B = torch.tensor([self.ids.index(t) for t in record.teacher_ids], device=device)
        owner_N = torch.repeat_interleave(owner_B, record.predicting_BT().sum(1))
        onehot_KN = owner_N[None, :] == torch.arange(len(self.ids), device=device)[:, None]
        sums_K = (onehot_KN * out.per_token_N[None, :]).sum(1)
        return out, self._sums(sums_K, onehot_KN.sum(1).to(out.per_token_N.dtype))


class Weighted(_TeacherSet, Teacher):
    """A `mixture.WeightedTeachers` as a teacher kind: every teacher's states and head, every row."""

    importance_weighted = True

    def __init__(self, module: mixture.WeightedTeachers):
        self.module = module.eval().requires_grad_(False)
        self._init_set(module)

    def start(self, student, tokenizer, args) -> None:
        for t in self.members.values():
            check_rows("teacher", t, tokenizer)
        self._set_tolerance(args)

    def prepare_rows(self, rows: list[dict], step: int) -> None:
        if rows:
            self.module.prepare_step(rows)

    def score(self, record: RolloutRecord, rows, fwd: dict, pred_BT: torch.Tensor):
        """Every teacher's (weight, states at the predicting positions, head)."""
        with torch.no_grad():
            return [
                (
                    self.module.weights[tid],
                    t.base_model(**fwd).last_hidden_state[pred_BT],
                    t.get_output_embeddings().weight,
                )
                for tid, t in self.members.items()
            ]

    def student_divergence(self, student, fwd, pred_BT, part, loss: LossSettings):
        return student_weighted_divergence(student, fwd, pred_BT, part, **loss.one_vocabulary())

    def output(self, parts: tuple, record: RolloutRecord, part):
        each_KN = parts[4]
        return super().output(parts, record, part)[0], self._sums(
            each_KN.sum(1), torch.full_like(each_KN[:, 0], each_KN.shape[1])
        )

    def plan_rows(self) -> list[PlanRow]:
        return [row for tid, t in self.members.items() for row in head_rows(f"teacher {tid}", t)]
