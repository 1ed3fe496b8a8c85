"""opdkit.opd.teachers.base: every teacher kind answers every call of the interface (`answers_every_call`, run
by each kind's own test file on its kind), every kind has a name, and `teachers.of` takes a kind as it is and
any other module as a teacher in process."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model, tiny_rollout
from test_opd_teachers_topk_divergence import _LogitsClient

from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.loss import DivergenceOutput
from opdkit.opd.teachers import of, sets, topk
from opdkit.opd.teachers.base import DivergenceInputs, Teacher
from opdkit.opd.teachers.cross import CrossTokenizerTeacher
from opdkit.opd.teachers.local import LocalTeacher
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
    own = kind.inputs(record)
    kind.prepare([(record, own)], step=0)  # the first step (0-based)
    n = kind.loss_count(record, own)
    assert n.dim() == 0 and float(n) > 0
    pred_BT = record.predicting_BT()
    fwd = dict(
        input_ids=record.input_ids_BT,
        attention_mask=record.attention_mask_BT,
        position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
        use_cache=False,
    )
    part = kind.score(record, own, fwd, pred_BT)
    given = DivergenceInputs(beta=1.0, temperature=1.0, vocab_size=len(tok), chunk_size=16)
    parts = kind.student_divergence(student, fwd, pred_BT, part, given)
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
    assert isinstance(kind.name, str) and kind.name  # how the log and the errors call it
    described = kind.describe("tiny:teacher")
    assert described is None or isinstance(described, str)
    assert isinstance(kind.exact, bool) and isinstance(kind.module, torch.nn.Module)
    return {"out": out, "n": n, "metrics": metrics, "fingerprint": fingerprint, "sums": sums}


def test_of_takes_a_kind_as_it_is_and_a_module_as_a_teacher_in_process(tmp_path):
    tok, bpe = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    t = tiny_model("tiny:teacher")
    assert type(of(t, tok)) is LocalTeacher
    for kind in (
        LocalTeacher(t),
        topk.TopKTeacher(_LogitsClient(t), 3),
        sets.RoutedTeacher({"a": t}),
        sets.WeightedTeachers({"a": t}, {"a": 1.0}),
    ):
        assert of(kind, tok) is kind and kind.module is not None
    cross = of(tiny_model("tiny:teacher-bpe"), tok, bpe, args(tmp_path))
    assert type(cross) is CrossTokenizerTeacher and type(cross.inner) is LocalTeacher
    with pytest.raises(ValueError, match="topk needs a teacher with the student's tokenizer"):
        of(topk.TopKTeacher(_LogitsClient(t), 3), tok, bpe, args(tmp_path))
    with pytest.raises(ValueError, match="several teachers need the student's tokenizer"):
        of(sets.RoutedTeacher({"a": t}), tok, bpe, args(tmp_path))


def test_a_kind_must_score_and_give_the_students_side():
    class Half(Teacher):
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_every_kind_has_a_name():
    """`Teacher.name` is declared by the interface and set by every kind (the trainer's errors read it)."""
    from opdkit.ads.teacher import ADSTeacher
    from opdkit.opd.teachers.served import ServedTeacher

    kinds = [LocalTeacher, ServedTeacher, topk.TopKTeacher, CrossTokenizerTeacher, ADSTeacher]
    kinds += [sets.RoutedTeacher, sets.WeightedTeachers]
    names = [k.name for k in kinds]
    assert all(isinstance(n, str) and n for n in names) and len(set(names)) == len(names)
    assert "name" in Teacher.__annotations__
