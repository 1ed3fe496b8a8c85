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
from opdkit.opd import mixture
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.loss import per_token_divergence
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import sampling
from opdkit.tiny import task


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
    routed = mixture.RoutedTeacher(teachers)
    batch = {"input_ids": r.input_ids_BT, "attention_mask": r.attention_mask_BT}
    batch["completion_mask_BC"], batch["teacher_id"] = r.completion_mask_BC, owners
    routed.prepare_step([batch])
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1
    )
    trainer = DistillTrainer(
        model=_model("tiny:student"), args=args, processing_class=tok, teacher_model=routed
    )
    loss = trainer.compute_loss(trainer.model, {k: v for k, v in batch.items() if k != "teacher_id"})
    with torch.no_grad():
        s_NV = _completion_logits(_model("tiny:student"), r)
        t_NV = {k: _completion_logits(m, r) for k, m in teachers.items()}
    row_N = torch.repeat_interleave(torch.arange(5), r.completion_mask_BC.sum(1))
    own_NV = torch.stack([t_NV[owners[int(b)]][n] for n, b in enumerate(row_N)])
    want = per_token_divergence(s_NV, own_NV, beta=1.0).sum() / r.completion_mask_BC.sum()
    loss = float(loss.detach())
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
    out, each = mixture.weighted_divergence(s_NH, s_VH, parts, beta=0.5, temperature=1.3)
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
    saved = mixture.fingerprints(teachers, probe)
    mixture.check_same_teachers(saved, mixture.fingerprints(dict(teachers), probe))
    swapped = {"big": teachers["small"], "small": teachers["big"]}
    with pytest.raises(mixture.TeacherSetMismatch, match="teacher 'big' scores the probe differently"):
        mixture.check_same_teachers(saved, mixture.fingerprints(swapped, probe))
    with pytest.raises(mixture.TeacherSetMismatch, match="resumed with \\['big'\\]"):
        mixture.check_same_teachers(saved, mixture.fingerprints({"big": teachers["big"]}, probe))
