"""opdkit.opd.teachers.base: every teacher kind answers every call of the interface (`answers_every_call`, run
by each kind's own test file on its kind), and `teachers.of` picks the kind of each teacher module."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_rollout
from test_opd_topk import _LogitsClient

from opdkit.models import load_tokenizer
from opdkit.opd import mixture, topk
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.loss import DivergenceOutput
from opdkit.opd.teachers import of
from opdkit.opd.teachers.base import LossSettings, PlanRow, Teacher
from opdkit.opd.teachers.cross import CrossTokenizerTeacher
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.opd.teachers.sets import Routed, Weighted
from opdkit.opd.teachers.topk import TopK
from opdkit.rollout import sampling, source


def args(tmp_path, **over) -> OPDArguments:
    return OPDArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **over)


def answers_every_call(kind: Teacher, tok, tmp_path, teacher_ids=None) -> dict:
    """Every call of `Teacher` on the tiny world's rollout, in the trainer's order, each answer of the type
    the interface promises; the loss is finite and reaches the student's weights. Returns what it got."""
    student = tiny_model("tiny:student")
    a = args(tmp_path)
    kind.start(student, tok, a)
    kind.place(torch.device("cpu"), shard=False)
    record = source.record_of(tiny_rollout(tiny_model("tiny:teacher"), tok), [tok.eos_token_id])
    if teacher_ids:
        record = source.RolloutRecord(**{**record.__dict__, "teacher_ids": teacher_ids(record)})
    rows = kind.rows(record)
    kind.prepare([(record, rows)], step=0)  # the first step (0-based)
    n = kind.loss_count(record, rows)
    assert n.dim() == 0 and float(n) > 0
    pred_BT = record.predicting_BT()
    fwd = dict(
        input_ids=record.input_ids_BT,
        attention_mask=record.attention_mask_BT,
        position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
        use_cache=False,
    )
    part = kind.score(record, rows, fwd, pred_BT)
    loss = LossSettings(beta=1.0, temperature=1.0, vocab_size=len(tok), chunk_size=16)
    parts = kind.student_divergence(student, fwd, pred_BT, part, loss)
    out, sums = kind.output(parts, record, part)
    assert isinstance(out, DivergenceOutput) and out.per_token_N.shape == (int(pred_BT.sum()),)
    assert torch.isfinite(out.sum) and out.student_entropy_N.shape == out.per_token_N.shape
    (out.sum / n).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    zero = kind.new_sums("cpu")
    if zero is not None:
        assert sums is None or sums.shape == zero.shape
        metrics = kind.metrics((zero + (0 if sums is None else sums.to(zero))).tolist())
    else:
        metrics = kind.metrics(None)
    assert isinstance(metrics, dict)
    probe = tok("12+34=46", add_special_tokens=False)["input_ids"]
    fingerprint = kind.fingerprint(probe)
    if fingerprint is not None:
        kind.check_same(fingerprint, kind.fingerprint(probe))  # the same teacher passes
    plan = kind.plan_rows()
    assert plan and all(isinstance(r, PlanRow) and r.bytes_per_token > 0 for r in plan)
    described = kind.describe("tiny:teacher")
    assert described is None or isinstance(described, str)
    assert isinstance(kind.exact, bool) and isinstance(kind.module, torch.nn.Module)
    return {"out": out, "n": n, "metrics": metrics, "fingerprint": fingerprint, "sums": sums}


def test_of_picks_each_teacher_modules_kind(tmp_path):
    tok, bpe = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    t = tiny_model("tiny:teacher")
    assert type(of(t, tok)) is LocalTeacher
    assert type(of(topk.TopKTeacher(_LogitsClient(t), 3), tok)) is TopK
    assert type(of(mixture.RoutedTeacher({"a": t}), tok)) is Routed
    assert type(of(mixture.WeightedTeachers({"a": t}, {"a": 1.0}), tok)) is Weighted
    kind = LocalTeacher(t)
    assert of(kind, tok) is kind  # a kind is taken as it is
    cross = of(tiny_model("tiny:teacher-bpe"), tok, bpe, args(tmp_path))
    assert type(cross) is CrossTokenizerTeacher and type(cross.inner) is LocalTeacher
    with pytest.raises(ValueError, match="topk needs a teacher with the student's tokenizer"):
        of(topk.TopKTeacher(_LogitsClient(t), 3), tok, bpe, args(tmp_path))
    with pytest.raises(ValueError, match="several teachers need the student's tokenizer"):
        of(mixture.RoutedTeacher({"a": t}), tok, bpe, args(tmp_path))


def test_a_kind_must_score_and_give_the_students_side():
    class Half(Teacher):
        def plan_rows(self):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Half()
