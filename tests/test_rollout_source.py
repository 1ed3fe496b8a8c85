"""opdkit.rollout.source: a record's loss mask is the unit of the loss. A single-turn rollout's mask is its
completion mask placed on the full row; the trainer reads the mask only: a token the mask leaves out inside a
completion carries exactly zero loss and gradient, whatever the teacher says there; the engine source gives
the records the trainer reads."""

from __future__ import annotations

import torch
from helpers import tiny_model, tiny_rollout

from opdkit.data.prompts import PromptCollator
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import source
from opdkit.tasks import tiny as task


def test_a_single_turn_records_mask_is_its_completion_mask_on_the_full_row():
    tok = load_tokenizer("tiny:student")
    r = tiny_rollout(tiny_model("tiny:teacher"), tok)
    r.logprobs_BC = torch.rand(r.completion_mask_BC.shape) * r.completion_mask_BC
    rec = source.record_of(r, [tok.eos_token_id])
    P = r.prompt_len
    assert torch.equal(rec.loss_mask_BT[:, P:], r.completion_mask_BC) and rec.loss_mask_BT[:, :P].sum() == 0
    # the state at t predicts token t+1: the prompt's last column predicts the first completion token
    want_pred = torch.zeros_like(rec.attention_mask_BT, dtype=torch.bool)
    want_pred[:, P - 1 : -1] = r.completion_mask_BC.bool()
    assert torch.equal(rec.predicting_BT(), want_pred)
    assert torch.equal(rec.context_BT()[:, :P], r.attention_mask_BT[:, :P].bool())
    assert not rec.context_BT()[:, P:].any()
    assert torch.equal(
        rec.sampling_logprobs_BT[rec.loss_mask_BT.bool()], r.logprobs_BC[r.completion_mask_BC.bool()]
    )
    assert torch.equal(rec.truncated_B, r.truncated_B([tok.eos_token_id]))


class _Perturbed(torch.nn.Module):
    """The teacher, its final state at one place (`b`, `t`) replaced by noise: its logits there change."""

    def __init__(self, teacher, b: int, t: int):
        super().__init__()
        self.teacher, self.at = teacher, (b, t)

    @property
    def base_model(self):
        outer = self

        class Backbone(torch.nn.Module):
            def forward(self, **fwd):
                out = outer.teacher.base_model(**fwd)
                h = out.last_hidden_state.clone()
                h[outer.at] = torch.randn(h.shape[-1], generator=torch.Generator().manual_seed(0)) * 3
                out.last_hidden_state = h
                return out

        return Backbone()

    def get_output_embeddings(self):
        return self.teacher.get_output_embeddings()


def _trainer(tmp_path, teacher) -> DistillTrainer:
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1
    )
    tok = load_tokenizer("tiny:student")
    return DistillTrainer(
        model=tiny_model("tiny:student"), args=args, processing_class=tok, teacher_model=teacher
    )


def _loss_and_grads(trainer, record) -> tuple[torch.Tensor, torch.Tensor, dict]:
    trainer.model.zero_grad()
    loss, out = trainer.compute_loss(trainer.model, trainer.micro_batch(record), return_outputs=True)
    loss.backward()
    return loss.detach(), out.per_token_N, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_a_token_the_mask_leaves_out_carries_no_loss_and_no_gradient(tmp_path):
    """A 0 inside row 0's completion (as a multi-turn episode's tool output would be): the teacher's logits
    at the position predicting it change nothing, loss or gradient, to the bit; with the token in the mask the
    same change moves both. The loss is the other tokens' divergence over their count."""
    tok = load_tokenizer("tiny:student")
    teacher = tiny_model("tiny:teacher")
    whole = source.record_of(tiny_rollout(teacher, tok), [tok.eos_token_id])
    first = int(whole.loss_mask_BT[0].nonzero()[0])
    hole = first + 2  # the third completion token of row 0
    assert whole.loss_mask_BT[0, hole + 1] == 1, "the hole lies inside the completion"
    mask_BT = whole.loss_mask_BT.clone()
    mask_BT[0, hole] = 0
    holed = source.RolloutRecord(**{**whole.__dict__, "loss_mask_BT": mask_BT})
    perturbed = _Perturbed(teacher, 0, hole - 1)  # the state that predicts the left-out token

    loss, per_token_N, grads = _loss_and_grads(_trainer(tmp_path / "a", teacher), holed)
    loss_p, _, grads_p = _loss_and_grads(_trainer(tmp_path / "b", perturbed), holed)
    assert torch.equal(loss, loss_p) and all(torch.equal(grads[n], grads_p[n]) for n in grads)

    full_loss, full_N, full_grads = _loss_and_grads(_trainer(tmp_path / "c", teacher), whole)
    full_loss_p, _, full_grads_p = _loss_and_grads(_trainer(tmp_path / "d", perturbed), whole)
    assert abs(float(full_loss_p - full_loss)) > 1e-3 * float(full_loss)
    assert any(not torch.allclose(full_grads[n], full_grads_p[n]) for n in full_grads)

    # the holed loss: every other token's divergence, over their count
    kept_N = torch.ones_like(full_N, dtype=torch.bool)
    kept_N[2] = False  # row 0's tokens come first; its third is the hole
    torch.testing.assert_close(per_token_N, full_N[kept_N], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(loss * mask_BT.sum(), per_token_N.sum(), rtol=1e-6, atol=0)


def test_the_engine_source_gives_a_steps_records_grouped_by_length(tmp_path):
    """Two prompt micro-batches sampled in one engine call: records of the same sizes, every row's place in
    the sampling order once, shorter completions first, each record's mask its own rows' sampled tokens."""
    tok = load_tokenizer("tiny:student")
    trainer = _trainer(tmp_path, tiny_model("tiny:teacher"))
    collate = PromptCollator(tok, 64)
    batches = [
        collate(
            [
                {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer}
                for p in task.problems(3, s)
            ]
        )
        for s in (1, 2)
    ]
    records = trainer.rollouts.next_step(trainer.model, batches, step=0)
    assert [r.input_ids_BT.shape[0] for r in records] == [3, 3]
    assert sorted(p for r in records for p in r.sampled_as) == list(range(6))
    lengths = [r.loss_mask_BT.sum(1).max() for r in records]
    assert lengths[0] <= lengths[1]
    answers = [a for b in batches for a in b["answers"]]
    for r in records:
        assert r.answers == [answers[p] for p in r.sampled_as]
        # sampled tokens only: attended, after the prompt, and every row has some
        assert (r.loss_mask_BT.bool() <= r.attention_mask_BT.bool()).all() and (
            r.loss_mask_BT.sum(1) > 0
        ).all()
