"""Several teachers (multi-teacher OPD): each row scored by the teacher its `teacher_id` names
(`RoutedTeacher`, one stacked teacher to the loss), or every row by a weighted sum of divergences to all of
them (`WeightedTeachers`: sum_k w_k D_k); each teacher's divergence logged as divergence/<id>; and the
fingerprint that refuses a resume with another set (one `TeacherSetMismatch` line, before any step). Every
teacher of a set reads the student's tokens (each is compared logit by logit).

    mix = RoutedTeacher({"math": served_math, "code": local_code})    # teachers in process or served
    mix.route(input_ids_BT, attention_mask_BT, ["math", "code", ...])  # or prepare_step(batches)
    trainer = DistillTrainer(..., teacher_model=mix)                   # a kind: taken as it is
    out = weighted_divergence(s_hidden_NH, s_head_VH, [(0.7, h1_NH, w1_VH), (0.3, h2_NH, w2_VH)], beta=1.0)

How routing reaches the exact divergence unchanged: it forms logits as hidden . head^T (`chunked_divergence`),
linear in the hidden state, so the teachers are presented as one (as `ads.teacher.ADSTeacher` presents three
models): head = [W_1 | W_2 | ...] side by side, and each row's hidden state is its own teacher's in that
teacher's block and zero elsewhere, so hidden . head^T is exactly its teacher's logits. Each teacher runs on
its own rows only. The price: the teacher's head matmul in the divergence is sum(H_k) wide instead of H.

Pitfalls this module exists for:
- a row is routed by its content (its unpadded token ids), not by its place: the trainer regroups a step's
  rows by completion length before cutting micro-batches, and a row must keep its teacher;
- teachers may pad their vocabularies differently: the stacked head keeps the rows all of them have (the
  trainer compares only the tokenizer's vocabulary, which every head must cover);
- a weighted mixture of divergences (sum of w_k D(student, teacher_k)) is not the divergence to any one
  mixed teacher (a mixture of distributions, or of logits, is another target): it needs one divergence per
  teacher, `weighted_divergence`, which `WeightedTeachers` calls instead of `chunked_divergence`;
- a resume must score with the same teachers: `fingerprints` (each teacher's log-probabilities of a probe)
  are saved with the run and compared (`check_same_teachers`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutput

from opdkit.opd.loss import DivergenceOutput, chunked_divergence
from opdkit.opd.teachers.base import DivergenceInputs, Teacher, check_head_covers, student_states
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.opd.teachers.served import FINGERPRINT_TOLERANCE, probe_logprobs
from opdkit.rollout.source import RolloutRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


class TeacherSetMismatch(ValueError):
    """A resumed run was given other teachers than it started with."""


def _row_key(ids_BT: torch.Tensor, attn_BT: torch.Tensor, b: int) -> bytes:
    return ids_BT[b][attn_BT[b].bool()].detach().cpu().numpy().astype(np.int64).tobytes()


class _RoutedBackbone(torch.nn.Module):
    def __init__(self, owner: RoutedTeacher):
        super().__init__()
        self._owner = [owner]  # a list: not a submodule (the owner holds this module)

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> BaseModelOutput:
        return BaseModelOutput(
            last_hidden_state=self._owner[0].stacked_states(input_ids, attention_mask, position_ids, **kwargs)
        )


def student_weighted_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    teachers: list[tuple[float, torch.Tensor, torch.Tensor]],
    **divergence,
) -> tuple[torch.Tensor, ...]:
    """`local.student_divergence` against several teachers at once: sum_k w_k D_k
    (`weighted_divergence`), then each teacher's own per-token divergence, stacked (K, N), to log."""
    s_hidden_NH, s_head_VH = student_states(student, fwd, pred_BT)
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out, each = weighted_divergence(s_hidden_NH, s_head_VH, teachers, **divergence)
    each_KN = torch.stack(each)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N, each_KN


REFUSAL = (
    "several teachers need the student's tokenizer (each is compared logit by logit); a teacher with another "
    "tokenizer can only be the one teacher of a run."
)


class _TeacherSet:
    """What both set kinds share: the per-teacher sums and columns, the fingerprint (`members`: the teachers
    by id, `ids` their order)."""

    another_tokenizer_refusal = REFUSAL

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
        return fingerprints(self.members, probe_ids)

    def check_same(self, saved: dict, now: dict) -> None:
        check_same_teachers(saved, now, self.tolerance)

    def _set_tolerance(self, args) -> None:
        dtypes = [getattr(t, "served_dtype", "float32") for t in self.members.values()]
        dtypes += ["bfloat16"] if args.bf16 else []
        self.tolerance = max(FINGERPRINT_TOLERANCE.get(d, 0.1) for d in dtypes)


class RoutedTeacher(_TeacherSet, LocalTeacher, torch.nn.Module):
    """Teachers by id, each row scored by its own (`route` or `prepare_step` says which): a teacher in
    process to the loss, the module it holds itself, whose `base_model` returns the stacked states and
    `get_output_embeddings` the stacked head (at least float32 when the teachers' dtypes differ)."""

    name = "routed teachers"

    def __init__(self, teachers: dict[str, torch.nn.Module]):
        torch.nn.Module.__init__(self)
        if not teachers:
            raise ValueError("RoutedTeacher needs at least one teacher: {id: model}")
        self.ids = list(teachers)
        self.teachers = torch.nn.ModuleDict({k: t.eval().requires_grad_(False) for k, t in teachers.items()})
        heads = [t.get_output_embeddings() for t in teachers.values()]
        if any(getattr(h, "bias", None) is not None for h in heads):
            raise ValueError(
                "RoutedTeacher stacks bias-free heads (logits = hidden . W^T); a head has a bias."
            )
        weights = [h.weight.detach() for h in heads]
        dtype = weights[0].dtype if all(w.dtype == weights[0].dtype for w in weights) else torch.float32
        rows = min(w.shape[0] for w in weights)
        self.widths = [w.shape[1] for w in weights]
        stacked_VH = torch.cat([w[:rows].to(weights[0].device, dtype) for w in weights], dim=1)
        self.head = torch.nn.Linear(stacked_VH.shape[1], rows, bias=False, device="meta")
        self.head.weight = torch.nn.Parameter(stacked_VH, requires_grad=False)
        self.config = next(iter(teachers.values())).config
        self.backbone = _RoutedBackbone(self)
        self._routes: dict[bytes, list[str]] = {}
        self.sharded = False
        self.members = dict(self.teachers.items())
        self.eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self

    @property
    def base_model(self) -> torch.nn.Module:
        return self.backbone

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def route(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, teacher_ids: list[str]
    ) -> None:
        """Remember which teacher scores each of these rows (looked up by the rows' tokens)."""
        unknown = sorted(set(teacher_ids) - set(self.ids))
        if unknown:
            raise ValueError(f"teacher_id {unknown} is not one of the teachers {self.ids}")
        for b, tid in enumerate(teacher_ids):
            self._routes.setdefault(_row_key(input_ids_BT, attention_mask_BT, b), []).append(tid)

    def prepare_step(self, batches: list[dict]) -> None:
        """`route` every micro-batch by its `teacher_id` list, then hand each teacher that prepares (a served
        one) its own rows."""
        for b in batches:
            self.route(b["input_ids"], b["attention_mask"], list(b["teacher_id"]))
        for tid, teacher in self.teachers.items():
            if hasattr(teacher, "prepare_step"):
                mine = [_rows(b, [i for i, t in enumerate(b["teacher_id"]) if t == tid]) for b in batches]
                teacher.prepare_step([m for m in mine if m["input_ids"].shape[0]])

    def _teacher_of(self, input_ids_BT, attention_mask_BT) -> list[str]:
        out = []
        for b in range(input_ids_BT.shape[0]):
            key = _row_key(input_ids_BT, attention_mask_BT, b)
            routes = self._routes.get(key)
            if not routes:
                raise KeyError(
                    f"row {b} of this batch was never routed to a teacher; call route() or prepare_step() "
                    "with each row's teacher_id before scoring it."
                )
            out.append(routes.pop(0))
            if not routes:
                del self._routes[key]
        return out

    def stacked_states(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        """(B, T, sum H_k): each row's own teacher's final states in that teacher's block, zero elsewhere."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        owners = self._teacher_of(input_ids, attention_mask)
        B, T = input_ids.shape
        out_BTS = torch.zeros(B, T, sum(self.widths), dtype=self.head.weight.dtype, device=input_ids.device)
        start = 0
        for tid, width in zip(self.ids, self.widths):
            rows = [b for b, o in enumerate(owners) if o == tid]
            if rows:
                sel = torch.tensor(rows, device=input_ids.device)
                fwd = dict(input_ids=input_ids[sel], attention_mask=attention_mask[sel], **kwargs)
                if position_ids is not None:
                    fwd["position_ids"] = position_ids[sel]
                h_RTH = self.teachers[tid].base_model(**fwd).last_hidden_state
                out_BTS[sel, :, start : start + width] = h_RTH.to(out_BTS.dtype)
            start += width
        return out_BTS

    def start(self, student, tokenizer, args) -> None:
        super().start(student, tokenizer, args)
        self._set_tolerance(args)

    def place(self, device, shard: bool) -> None:
        self.to(device)

    def prepare_batches(self, batches: list[dict], step: int) -> None:
        if batches:
            self.prepare_step(batches)

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


class WeightedTeachers(_TeacherSet, Teacher, torch.nn.Module):
    """Teachers by id, every row scored by all of them (each one's states and head): the loss is sum_k w_k
    D(student, teacher_k) (`weighted_divergence`), not the divergence to a mixed teacher. `weights`: {id: w},
    each >= 0, not all 0 (not normalised: the loss is the weighted sum as given). The module it holds is
    itself."""

    name = "weighted teachers"
    importance_weighted = True

    def __init__(self, teachers: dict[str, torch.nn.Module], weights: dict[str, float]):
        torch.nn.Module.__init__(self)
        if not teachers:
            raise ValueError("WeightedTeachers needs at least one teacher: {id: model}")
        if set(weights) != set(teachers):
            raise ValueError(
                f"teacher_weights names {sorted(weights)} but the teachers are {sorted(teachers)}; give one "
                "weight per teacher id."
            )
        if any(not w >= 0 for w in weights.values()) or not sum(weights.values()) > 0:
            raise ValueError(f"teacher_weights {weights}: each weight >= 0, and not all 0")
        self.ids = list(teachers)
        self.teachers = torch.nn.ModuleDict({k: t.eval().requires_grad_(False) for k, t in teachers.items()})
        self.weights = {k: float(weights[k]) for k in self.ids}
        self.config = next(iter(teachers.values())).config
        self.members = dict(self.teachers.items())
        self.eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self

    def prepare_step(self, batches: list[dict]) -> None:
        """Every teacher that prepares (a served one) gets the step's rows."""
        for teacher in self.teachers.values():
            if hasattr(teacher, "prepare_step"):
                teacher.prepare_step(batches)

    def start(self, student, tokenizer, args) -> None:
        for t in self.members.values():
            check_head_covers("teacher", t, tokenizer)
        self._set_tolerance(args)

    def prepare_batches(self, batches: list[dict], step: int) -> None:
        if batches:
            self.prepare_step(batches)

    def score(self, record: RolloutRecord, own, fwd: dict, pred_BT: torch.Tensor):
        """Every teacher's (weight, states at the predicting positions, head)."""
        with torch.no_grad():
            return [
                (
                    self.weights[tid],
                    t.base_model(**fwd).last_hidden_state[pred_BT],
                    t.get_output_embeddings().weight,
                )
                for tid, t in self.members.items()
            ]

    def student_divergence(self, student, fwd, pred_BT, part, given: DivergenceInputs):
        return student_weighted_divergence(student, fwd, pred_BT, part, **given.one_vocabulary())

    def output(self, parts: tuple, record: RolloutRecord, part):
        each_KN = parts[4]
        return super().output(parts, record, part)[0], self._sums(
            each_KN.sum(1), torch.full_like(each_KN[:, 0], each_KN.shape[1])
        )


def _rows(batch: dict, rows: list[int]) -> dict:
    sel = torch.tensor(rows, dtype=torch.long)
    return {k: batch[k][sel.to(batch[k].device)] for k in ("input_ids", "attention_mask", "pred_BT")}


def weighted_divergence(
    student_hidden_NH: torch.Tensor,
    student_head_weight_VH: torch.Tensor,
    teachers: list[tuple[float, torch.Tensor, torch.Tensor]],
    **divergence,
) -> tuple[DivergenceOutput, list[torch.Tensor]]:
    """sum_k w_k D(student, teacher_k) per token, from each teacher's (weight, hidden states, head): the
    summed output (its `per_token_N` the weighted per-token divergence) and each teacher's own per-token
    divergence, for logging. `divergence`: `chunked_divergence`'s keywords."""
    if not teachers:
        raise ValueError("weighted_divergence needs at least one (weight, hidden_NH, head_VH)")
    outs = [
        chunked_divergence(student_hidden_NH, student_head_weight_VH, h_NH, w_VH, **divergence)
        for _, h_NH, w_VH in teachers
    ]
    weights = [float(w) for w, _, _ in teachers]
    total = sum(w * o.sum for w, o in zip(weights, outs))
    per_token_N = sum(w * o.per_token_N for w, o in zip(weights, outs))
    first = outs[0]
    return (
        DivergenceOutput(total, per_token_N, first.student_entropy_N, first.student_token_logprob_N),
        [o.per_token_N for o in outs],
    )


@torch.no_grad()
def fingerprint(teacher: torch.nn.Module, probe_ids: list[int]) -> list[float]:
    """The teacher's log-probability of each next probe token, through the trainer's own path (its
    `base_model` states and output head): the same numbers for the same teacher, local or served."""
    weight_VH = teacher.get_output_embeddings().weight
    ids_1T = torch.tensor([probe_ids], device=weight_VH.device)
    h_TH = teacher.base_model(input_ids=ids_1T, attention_mask=torch.ones_like(ids_1T)).last_hidden_state[0]
    return probe_logprobs(h_TH, weight_VH, probe_ids)


def fingerprints(teachers: dict[str, torch.nn.Module], probe_ids: list[int]) -> dict:
    """What a run saves of its teacher set: the probe and each teacher's `fingerprint`."""
    return {
        "probe_ids": list(probe_ids),
        "teachers": {k: fingerprint(t, probe_ids) for k, t in teachers.items()},
    }


def check_same_teachers(saved: dict, now: dict, tolerance: float = 1e-3) -> None:
    """Refuse (`TeacherSetMismatch`) a resume whose teachers differ from the run's: other ids, or a teacher
    whose probe log-probabilities moved by more than `tolerance` (1e-3 suits float32 teachers; bf16 ones,
    or a server batching differently, need ~0.1)."""
    if saved["probe_ids"] != now["probe_ids"]:
        raise TeacherSetMismatch(
            "the saved teacher fingerprints used another probe; compare with the same one."
        )
    a, b = saved["teachers"], now["teachers"]
    if set(a) != set(b):
        raise TeacherSetMismatch(
            f"this run started with the teachers {sorted(a)} and is resumed with {sorted(b)}; resume "
            "with the same teachers, or start a new run."
        )
    for k in a:
        gap = float(np.abs(np.array(a[k]) - np.array(b[k])).max()) if a[k] else 0.0
        if not gap <= tolerance:
            raise TeacherSetMismatch(
                f"teacher {k!r} scores the probe differently than when this run started (largest log-prob "
                f"difference {gap:.3g}, tolerance {tolerance:g}): it is another model; resume with the run's "
                "teacher, or start a new run."
            )
