"""Several teachers: routed rows score with their own teacher inside an unchanged `DistillTrainer` (checked
against per-row divergences from full logits), the weighted divergence is the weighted sum, and a resume with
another teacher set is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.data.prompts import PromptCollator
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.loss import per_token_divergence
from opdkit.opd.teachers import sets
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import sampling, source
from opdkit.tasks import tiny as task


def _model(name: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name)).eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:student")


@pytest.fixture(scope="module")
def teachers() -> dict[str, torch.nn.Module]:
    """Two teachers of different widths: the tiny teacher (H 128) and the tiny student (another H)."""
    return {"big": _model("tiny:teacher"), "small": _model("tiny:student")}


@pytest.fixture(scope="module")
def rollout(tok) -> sampling.Rollout:
    batch = PromptCollator(tok, 64)(
        [{"messages": [{"role": "user", "content": p.prompt}]} for p in task.problems(5, 4)]
    )
    torch.manual_seed(3)
    return sampling.sample(
        _model("tiny:student"),
        batch["prompts"],
        batch["prompt_attention_mask"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )


def _completion_logits(model, r: sampling.Rollout) -> torch.Tensor:
    """(N, V) logits at the positions that predict completion tokens, row after row."""
    P = r.prompt_len
    fwd = dict(input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT)
    return model(**fwd).logits[:, P - 1 : -1][r.completion_mask_BC.bool()]


def test_routed_rows_score_with_their_own_teacher_in_the_trainer(tmp_path, tok, teachers, rollout):
    r = rollout
    owners = ["big", "small", "small", "big", "small"]
    routed = sets.RoutedTeacher(teachers)
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1
    )
    trainer = DistillTrainer(
        model=_model("tiny:student"), args=args, processing_class=tok, teacher_model=routed
    )
    batch = trainer.micro_batch(source.record_of(r, trainer.stop_ids, teacher_ids=owners))
    trainer.teacher.prepare([(batch["record"], batch["teacher_inputs"])], step=0)
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        s_NV = _completion_logits(_model("tiny:student"), r)
        t_NV = {k: _completion_logits(m, r) for k, m in teachers.items()}
    row_N = torch.repeat_interleave(torch.arange(5), r.completion_mask_BC.sum(1))
    own_NV = torch.stack([t_NV[owners[int(b)]][n] for n, b in enumerate(row_N)])
    own_N = per_token_divergence(s_NV, own_NV, beta=1.0)
    want = own_N.sum() / r.completion_mask_BC.sum()
    loss = float(loss.detach())
    # each teacher's metric: the divergence of its own rows' tokens only
    owner_N = [owners[int(b)] for b in row_N]
    per = trainer.stats.teacher_sums.tolist()
    for j, tid in enumerate(["big", "small"]):
        mine = torch.tensor([o == tid for o in owner_N])
        assert per[j] == pytest.approx(float(own_N[mine].sum()), rel=1e-5) and per[2 + j] == int(mine.sum())
    assert loss == pytest.approx(float(want), rel=1e-5)
    everyone_big = per_token_divergence(s_NV, t_NV["big"], beta=1.0).sum() / r.completion_mask_BC.sum()
    assert abs(loss - float(everyone_big)) > 1e-3  # the routing mattered
    with pytest.raises(KeyError, match="never routed"):  # each routed row is used once
        routed.stacked_states(r.input_ids_BT, r.attention_mask_BT)


def test_the_weighted_divergence_is_the_weighted_sum_of_each_teachers(teachers, rollout):
    g = torch.Generator().manual_seed(0)
    s_NH = torch.randn(9, 16, generator=g).requires_grad_()
    s_VH = torch.randn(101, 16, generator=g).requires_grad_()
    parts = [
        (0.7, torch.randn(9, 8, generator=g), torch.randn(101, 8, generator=g)),
        (0.3, *(torch.randn(9, 24, generator=g), torch.randn(101, 24, generator=g))),
    ]
    out, each = sets.weighted_divergence(s_NH, s_VH, parts, beta=0.5, temperature=1.3)
    out.sum.backward()
    s2_NH, s2_VH = s_NH.detach().clone().requires_grad_(), s_VH.detach().clone().requires_grad_()
    direct_N = [per_token_divergence(s2_NH @ s2_VH.T, h @ w.T, 0.5, 1.3) for _, h, w in parts]
    (0.7 * direct_N[0].sum() + 0.3 * direct_N[1].sum()).backward()
    for got, want in zip(each, direct_N):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_token_N, 0.7 * direct_N[0].detach() + 0.3 * direct_N[1].detach())
    torch.testing.assert_close(s_NH.grad, s2_NH.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_VH.grad, s2_VH.grad, rtol=1e-5, atol=1e-6)


def test_a_resume_with_another_teacher_set_is_refused(teachers):
    probe = [5, 6, 7, 8, 9]
    saved = sets.fingerprints(teachers, probe)
    sets.check_same_teachers(saved, sets.fingerprints(dict(teachers), probe))
    swapped = {"big": teachers["small"], "small": teachers["big"]}
    with pytest.raises(sets.TeacherSetMismatch, match="teacher 'big' scores the probe differently"):
        sets.check_same_teachers(saved, sets.fingerprints(swapped, probe))
    with pytest.raises(sets.TeacherSetMismatch, match="resumed with \\['big'\\]"):
        sets.check_same_teachers(saved, sets.fingerprints({"big": teachers["big"]}, probe))


def _perturbed(name: str, seed: int = 0) -> torch.nn.Module:
    """The model with noise added to every weight: another teacher of the same shape."""
    model = _model(name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.std().clamp(min=1e-3))
    return model


def test_the_trainer_with_weighted_teachers_takes_the_weighted_sum_and_logs_each(tmp_path, tok, rollout):
    """`WeightedTeachers` (the tiny teacher and a perturbed copy, 0.7 / 0.3) in `DistillTrainer`: the loss is
    (0.7 D1 + 0.3 D2) / N from full logits, and each teacher's own divergence is kept for its metric."""
    r = rollout
    teachers = {"a": _model("tiny:teacher"), "b": _perturbed("tiny:teacher")}
    mix = sets.WeightedTeachers(teachers, {"a": 0.7, "b": 0.3})
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1
    )
    trainer = DistillTrainer(model=_model("tiny:student"), args=args, processing_class=tok, teacher_model=mix)
    batch = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
    loss = float(trainer.compute_loss(trainer.model, batch).detach())
    n = r.completion_mask_BC.sum()
    with torch.no_grad():
        s_NV = _completion_logits(_model("tiny:student"), r)
        d = {
            k: float(per_token_divergence(s_NV, _completion_logits(m, r), beta=1.0).sum())
            for k, m in teachers.items()
        }
    assert loss == pytest.approx(float((0.7 * d["a"] + 0.3 * d["b"]) / n), rel=1e-5)
    assert abs(d["a"] - d["b"]) > 1e-3 * d["a"]  # the two teachers differ
    sums = trainer.stats.teacher_sums.tolist()
    assert sums[:2] == pytest.approx([d["a"], d["b"]], rel=1e-5) and sums[2:] == [float(n)] * 2
    with pytest.raises(ValueError, match="one weight per teacher id"):
        sets.WeightedTeachers(teachers, {"a": 1.0})


def _train(tmp_path, tok, teacher, steps: int, resume: str | None = None) -> DistillTrainer:
    from datasets import Dataset

    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer, "teacher_id": tid}
        for p, tid in zip(task.problems(8, 9), ["a", "b"] * 4)
    ]
    args = OPDArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        sample_every=0,
        max_steps=steps,
        per_device_train_batch_size=4,
        rollout_max_new_tokens=task.MAX_COMPLETION_TOKENS,
        logging_steps=1,
        disable_tqdm=True,
        save_strategy="steps",
        save_steps=1,
        remove_unused_columns=False,
    )
    trainer = DistillTrainer(
        model=_model("tiny:student"),
        args=args,
        processing_class=tok,
        teacher_model=teacher,
        train_dataset=Dataset.from_list(rows),
        data_collator=PromptCollator(tok, 64),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_routed_training_logs_each_teachers_divergence_and_a_resume_with_another_set_is_refused(
    tmp_path, tok
):
    """A `teacher_id` column routes each prompt (the collator carries it through the rollout); every step
    logs divergence/a and divergence/b; the fingerprints are saved with the run; a resume with the same
    set continues, with another (a teacher swapped for a perturbed copy) it stops with one line."""
    a, b = _model("tiny:teacher"), _perturbed("tiny:teacher")
    first = _train(tmp_path, tok, sets.RoutedTeacher({"a": a, "b": b}), steps=1)
    logged = [h for h in first.state.log_history if "loss" in h][0]
    assert logged["divergence/a"] > 0 and logged["divergence/b"] > 0
    assert (tmp_path / "teachers.json").exists()
    again = _train(tmp_path, tok, sets.RoutedTeacher({"a": a, "b": b}), 2, str(tmp_path / "checkpoint-1"))
    assert again.state.global_step == 2
    other = sets.RoutedTeacher({"a": a, "b": _perturbed("tiny:teacher", seed=1)})
    with pytest.raises(sets.TeacherSetMismatch, match="teacher 'b' scores the probe differently"):
        _train(tmp_path, tok, other, 3, str(tmp_path / "checkpoint-2"))
