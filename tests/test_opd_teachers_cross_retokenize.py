"""A teacher with another tokenizer inside `DistillTrainer`: on a fixed batch the trainer's loss and the
student's gradient equal TRL's `ULDLoss` fed by TRL's own teacher inputs (`build_teacher_inputs_from_texts`)
and the models' plain forward passes, in float64; the same tokenizer keeps the same-tokenizer path exactly;
what cannot be aligned is refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from opdkit import tiny
from opdkit.build.bpe_teacher import build_bpe_tokenizer
from opdkit.config import ConfigError
from opdkit.data.prompts import PromptCollator
from opdkit.models import load_tokenizer, small_qwen3
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.teachers import cross
from opdkit.opd.teachers.local import student_divergence
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import sampling, source
from opdkit.tasks import tiny as task

COMPLETIONS = ["4+7=11,1+7+2=10,5+1+7=13;1301", "12+5=17;17", "99", "3+8=11,\n0+1=1;408"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:student")


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(pieces="symbol-digit")  # groups of two characters to one token in every row


def _student() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")).double().eval()


def _teacher(vocab: int) -> torch.nn.Module:
    return small_qwen3(64, 2, vocab, seed=5).double().eval()


def _args(tmp_path, **over) -> OPDArguments:
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no")
    return OPDArguments(**{**base, "max_steps": 1, **over})


def _rollout(tok) -> sampling.Rollout:
    """Four prompts of the tiny task with fixed completions, each ended by the EOS (TRL drops the last token
    of a completion whatever it is, so only completions that stopped are compared)."""
    problems = task.problems(len(COMPLETIONS), 9)
    batch = PromptCollator(tok, 64)([{"messages": [{"role": "user", "content": p.prompt}]} for p in problems])
    comps = [tok.encode(c, add_special_tokens=False) + [tok.eos_token_id] for c in COMPLETIONS]
    width = max(len(c) for c in comps)
    ids_BC = torch.full((len(comps), width), tok.pad_token_id)
    mask_BC = torch.zeros(len(comps), width, dtype=torch.long)
    for b, c in enumerate(comps):
        ids_BC[b, : len(c)], mask_BC[b, : len(c)] = torch.tensor(c), 1
    return sampling.Rollout(
        torch.cat([batch["prompts"], ids_BC], 1),
        torch.cat([batch["prompt_attention_mask"], mask_BC], 1),
        mask_BC,
        batch["prompts"].shape[1],
    )


def _trainer(tmp_path, tok, teacher_tok, teacher, **over) -> DistillTrainer:
    return DistillTrainer(
        model=_student(),
        args=_args(tmp_path, **over),
        processing_class=tok,
        teacher_model=teacher,
        teacher_tokenizer=teacher_tok,
    )


def _trl_loss(tok, bpe, student, teacher, r: sampling.Rollout, hybrid: bool, merge: str) -> torch.Tensor:
    """TRL's reduction per row (the mean over the row's groups), recombined as the trainer's mean over all
    groups of the batch: sum over rows of groups x row loss / groups. Teacher inputs from TRL's own builder;
    the groups of a row counted here from byte ends (where both sides' text ends coincide)."""
    gold = pytest.importorskip("trl.experimental.gold.gold_trainer")
    config = SimpleNamespace(
        uld_crossentropy_weight=0.0,
        uld_distillation_weight=1.0,
        uld_student_temperature=1.0,
        uld_teacher_temperature=1.0,
        uld_skip_student_eos=True,
        uld_skip_teacher_eos=True,
        use_extended_uld=True,
        uld_token_merge_strategy=merge,
        uld_use_hybrid_loss=hybrid,
        uld_hybrid_matched_weight=None,
        uld_hybrid_unmatched_weight=None,
        beta=1.0,
    )
    uld = gold.ULDLoss(config, student_tokenizer=tok, teacher_tokenizer=bpe)
    P = r.prompt_len
    total, groups = 0.0, 0
    for b in range(r.input_ids_BT.shape[0]):
        keep = r.attention_mask_BT[b].bool()
        ids = r.input_ids_BT[b][keep]
        n_prompt = int(r.attention_mask_BT[b, :P].sum())
        completion = ids[n_prompt:].tolist()
        text = tok.decode(completion[:-1])
        prompt_text = tok.decode(ids[:n_prompt].tolist(), skip_special_tokens=False)
        t_ids, t_labels, t_attn, t_off = gold.build_teacher_inputs_from_texts(bpe, [prompt_text], [text])
        s_labels = ids.clone().unsqueeze(0)
        s_labels[0, :n_prompt] = -100
        s_off = torch.zeros(1, len(ids), 2, dtype=torch.long)
        ends = torch.tensor([len(tok.decode(completion[: k + 1]).encode()) for k in range(len(completion))])
        s_off[0, n_prompt:, 1] = ends
        s_off[0, n_prompt:, 0] = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])
        s_logits = student(ids.unsqueeze(0)).logits
        with torch.no_grad():
            t_logits = teacher(t_ids, attention_mask=t_attn).logits
        loss = uld(
            s_logits,
            t_logits,
            s_labels,
            t_labels,
            ids.unsqueeze(0),
            t_ids,
            student_byte_offsets=s_off,
            teacher_byte_offsets=t_off,
        )
        t_ends = t_off[0][t_labels[0] != -100][:-1, 1].tolist()  # the teacher's completion, EOS left out
        n = len(set(ends[:-1].tolist()) & set(t_ends))
        total, groups = total + n * loss, groups + n
    return total / groups


@pytest.mark.parametrize("hybrid,merge", [(False, "bayesian"), (True, "bayesian")])
def test_trainer_loss_and_gradient_equal_trl_uld_loss(tmp_path, tok, bpe, hybrid, merge):
    teacher = _teacher(len(bpe))
    trainer = _trainer(
        tmp_path, tok, bpe, teacher, crosstok_hybrid=hybrid, crosstok_merge=merge, loss_chunk_size=3
    )
    assert trainer.teacher.tokenizer is bpe
    r = _rollout(tok)
    inputs = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    student = _student()
    want = _trl_loss(tok, bpe, student, teacher, r, hybrid, merge)
    want.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-9)
    for name, p in student.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-8, atol=1e-12)


def test_the_start_message_names_the_overlap(tmp_path, tok, bpe):
    retokenizer = cross.Retokenizer.of(tok, bpe, _args(tmp_path))
    shared, vocab = retokenizer.overlap()
    spelled_alike = set(tok.get_vocab()) & set(bpe.get_vocab())
    assert (shared, vocab) == (len(spelled_alike), len(bpe))
    assert f"{shared:,} of the teacher's {vocab:,}" in retokenizer.describe("tiny:teacher-bpe")


def test_the_same_tokenizer_keeps_the_same_tokenizer_path(tmp_path, tok):
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).double().eval()
    trainer = _trainer(tmp_path, tok, load_tokenizer("tiny:teacher"), teacher)
    assert trainer.teacher.tokenizer is None
    r = _rollout(tok)
    inputs = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
    assert inputs["teacher_inputs"] is None
    loss = trainer.compute_loss(trainer.model, inputs)
    # The same-tokenizer divergence called directly, as the trainer did before cross-tokenizer teachers.
    P = r.prompt_len
    pred = torch.zeros_like(r.attention_mask_BT, dtype=torch.bool)
    pred[:, P - 1 : P - 1 + r.completion_mask_BC.shape[1]] = r.completion_mask_BC.bool()
    fwd = dict(
        input_ids=r.input_ids_BT,
        attention_mask=r.attention_mask_BT,
        position_ids=r.position_ids_BT,
        use_cache=False,
    )
    with torch.no_grad():
        t_hidden = teacher.base_model(**fwd).last_hidden_state[pred]
        div = student_divergence(
            _student(), fwd, pred, t_hidden, teacher.lm_head.weight, beta=1.0, vocab_size=len(tok)
        )[0]
    assert torch.equal(loss.detach(), div / r.completion_mask_BC.sum())


def test_what_cannot_be_aligned_is_refused_in_one_line(tmp_path, tok):
    word = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=word, eos_token="[UNK]")
    with pytest.raises(ConfigError, match="differs from the student's and .*positional") as err:
        cross.Retokenizer.of(tok, wordpiece, _args(tmp_path))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="comparisons only"):
        trl_rows = _args(tmp_path, crosstok_merge="observed-trl")
        cross.Retokenizer.of(tok, build_bpe_tokenizer(), trl_rows)


def test_micro_batches_add_up_to_the_whole_batch(tmp_path, tok, bpe):
    """The step's loss is the mean over its groups: two micro-batches, each divided by the step's group
    count (what `get_batch_samples` passes as num_items_in_batch), give the whole batch's loss and gradient"""
    trainer = _trainer(tmp_path, tok, bpe, _teacher(len(bpe)))
    r = _rollout(tok)
    whole = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
    n = whole["teacher_inputs"]["crosstok_groups"]
    trainer.compute_loss(trainer.model, whole, num_items_in_batch=n).backward()
    want = {k: p.grad.clone() for k, p in trainer.model.named_parameters()}
    trainer.model.zero_grad()
    total = 0.0
    for rows in (torch.tensor([0, 2]), torch.tensor([1, 3])):
        part = trainer.micro_batch(source.record_of(r.rows(rows), trainer.stop_ids))
        loss = trainer.compute_loss(trainer.model, part, num_items_in_batch=n)
        loss.backward()
        total += float(loss.detach())
    with torch.no_grad():
        whole_loss = float(trainer.compute_loss(trainer.model, whole, num_items_in_batch=n))
    assert total == pytest.approx(whole_loss, rel=1e-12)
    for k, p in trainer.model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], rtol=1e-9, atol=1e-12)
