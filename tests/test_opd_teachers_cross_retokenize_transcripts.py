"""A teacher with another tokenizer over multi-turn transcripts (`Retokenizer.prepare_transcripts`): the
trainer's loss and the student's gradient equal a direct computation over the student's turns (the teacher's
own chat template renders the conversation, one plain forward of each model, groups where both sides' byte
ends coincide inside each turn, the bayesian merge, ULD's sorted L1, the mean over groups); a teacher whose
template does not write a student turn as it was sampled is refused in one line."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import call, play
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.config import ConfigError
from opdkit.models import load_tokenizer, small_qwen3
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.tasks import tinytools
from opdkit.tasks.calculator import CalculatorEnvironment
from opdkit.tiny.tokenizer import SPECIALS, wrap

ASSISTANT = "<|im_start|>assistant\n"
# Three episodes: a call then the answer; the answer at once; a call then an answer cut at its token limit.
SCRIPTS = {
    "123+456+789+100": [call("123+456+789+100"), ";1468"],
    "111+222+333+444": [";1110"],
    "500+500+100+200": [call("500+500+100+200"), ";" + "1300" * 30],
}
MAX_NEW_TOKENS = 100  # a call (95 characters) and its stop token fit; the last episode's answer does not


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:student")


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE (digits one a token) whose merges join the tool call's words: the student's
    characters meet a teacher token of several of them in every call."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(
        ["system", "user", "assistant", call("1+2"), "<tool_response>", "calculator"] * 20, trainer=trainer
    )
    out = wrap(core)
    out.name_or_path = "test-bpe"
    return out


def _record(tok):
    env = CalculatorEnvironment(tinytools.TinyToolsTask())
    records, _, _ = play(tok, SCRIPTS, env, [len(SCRIPTS)], max_new_tokens=MAX_NEW_TOKENS)
    (record,) = records
    return record, env


def _trainer(tmp_path, tok, bpe, teacher) -> DistillTrainer:
    args = OPDArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, sample_every=0, save_strategy="no", max_steps=1,
        crosstok_hybrid=False, crosstok_merge="bayesian", loss_chunk_size=5,
    )  # fmt: skip
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")).double().eval()
    return DistillTrainer(
        model=student, args=args, processing_class=tok, teacher_model=teacher, teacher_tokenizer=bpe
    )


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _merged(logp_TV: torch.Tensor, positions: list[int], ids: list[int]) -> torch.Tensor:
    """Bayesian merge of the tokens at `positions` (token k predicted by row k-1): the last token's whole
    distribution times the probability of each earlier actual token."""
    p = logp_TV[positions[-1] - 1].exp()
    for k in positions[:-1]:
        p = p * logp_TV[k - 1, ids[k]].exp()
    return p


def _sorted_l1(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    n = max(len(p), len(q))
    ps = torch.nn.functional.pad(p.sort(descending=True).values, (0, n - len(p)))
    qs = torch.nn.functional.pad(q.sort(descending=True).values, (0, n - len(q)))
    return (ps - qs).abs().sum()


def _direct_loss(tok, bpe, env, student, teacher, record) -> tuple[torch.Tensor, int, int]:
    """The mean of the groups' sorted L1 over every row's student turns, from the record's tokens alone:
    (loss, groups, rows with a cut last turn)."""
    total, groups, cut = 0.0, 0, 0
    eos_s, eos_t = tok.eos_token_id, bpe.eos_token_id
    for b in range(record.input_ids_BT.shape[0]):
        keep = record.attention_mask_BT[b].bool()
        ids, mask = record.input_ids_BT[b][keep].tolist(), record.loss_mask_BT[b][keep].tolist()
        runs = _runs(mask)
        # The conversation, read back from the transcript: the prompt's user turn, each student turn's text,
        # the tool results between them.
        prompt_text = tok.decode(ids[: runs[0][0]], skip_special_tokens=False)
        messages = [
            {"role": "user", "content": prompt_text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]}
        ]
        texts = []
        for k, (a, z) in enumerate(runs):
            texts.append(tok.decode(ids[a:z], skip_special_tokens=True))
            messages.append({"role": "assistant", "content": texts[-1]})
            after = tok.decode(
                ids[z : runs[k + 1][0]] if k + 1 < len(runs) else [], skip_special_tokens=False
            )
            for result in re.findall(r"<tool_response>\n(.*?)\n</tool_response>", after, re.S):
                messages.append({"role": "tool", "content": result})
        rendering = bpe.apply_chat_template(messages, tools=env.tools, tokenize=False)
        enc = bpe(rendering, add_special_tokens=False, return_offsets_mapping=True)
        t_ids, offsets = enc["input_ids"], enc["offset_mapping"]
        with torch.no_grad():
            lp_t = torch.log_softmax(teacher(torch.tensor([t_ids])).logits[0].double(), -1)
        lp_s = torch.log_softmax(student(torch.tensor([ids])).logits[0][:, : len(tok)], -1)
        starts = [m.end() for m in re.finditer(re.escape(ASSISTANT), rendering)]
        assert len(starts) == len(runs)
        for (a, z), text, start in zip(runs, texts, starts):
            end = start + len(text)
            assert rendering[start:end] == text
            inside = [j for j, (o0, o1) in enumerate(offsets) if o0 >= start and o1 <= end and o1 > o0]
            assert offsets[inside[0]][0] == start and offsets[inside[-1]][1] == end  # token boundaries here
            stopped = ids[z - 1] == eos_s
            s_pos = list(range(a, z - 1 if stopped else z))  # a stop token is skipped (skip-EOS)
            cut += not stopped
            if stopped:
                assert t_ids[inside[-1] + 1] == eos_t  # the teacher reads its own EOS after the turn
            s_end = {len(tok.decode(ids[a : k + 1]).encode()): k for k in s_pos}
            t_end = {len(rendering[start : offsets[j][1]].encode()): j for j in inside}
            prev_s, prev_t = a, inside[0]
            for e in sorted(set(s_end) & set(t_end)):
                s_group, t_group = list(range(prev_s, s_end[e] + 1)), list(range(prev_t, t_end[e] + 1))
                prev_s, prev_t = s_end[e] + 1, t_end[e] + 1
                p_s = _merged(lp_s, s_group, ids)
                p_t = _merged(lp_t, t_group, t_ids)
                total, groups = total + _sorted_l1(p_s, p_t), groups + 1
    return total / groups, groups, cut


def test_the_loss_over_a_transcript_equals_the_direct_computation_on_the_students_turns(tmp_path, tok, bpe):
    record, env = _record(tok)
    assert record.loss_mask_BT.sum() > 0 and record.conversations is not None
    teacher = small_qwen3(64, 2, len(bpe), seed=5).double().eval()
    trainer = _trainer(tmp_path, tok, bpe, teacher)
    inputs = trainer.micro_batch(record)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")).double().eval()
    want, groups, cut = _direct_loss(tok, bpe, env, student, teacher, record)
    assert cut == 1 and groups > 0
    # multi-character teacher tokens: fewer groups than the student's turn tokens
    assert groups < int(record.loss_mask_BT.sum()) - 4  # 4 stop tokens, skipped
    want.backward()
    assert float(inputs["teacher_inputs"]["crosstok_groups"]) == groups
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-9)
    for name, p in student.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-8, atol=1e-12)


def test_a_template_that_does_not_write_a_turn_as_sampled_is_refused_in_one_line(tmp_path, tok, bpe):
    trimming = copy.deepcopy(bpe)
    trimming.chat_template = bpe.chat_template.replace(
        "message['content'] if message['content'] is string else ''",
        "message['content'] | replace('1468', '1,468') if message['content'] is string else ''",
    )
    assert trimming.chat_template != bpe.chat_template
    record, _ = _record(tok)
    teacher = small_qwen3(64, 2, len(bpe), seed=5).eval()
    trainer = _trainer(tmp_path, tok, trimming, teacher)
    with pytest.raises(
        ConfigError, match=r"teacher test-bpe does not reproduce the student's turn 2 of 2"
    ) as e:
        trainer.micro_batch(record)
    assert "\n" not in str(e.value) and "';1468'" in str(e.value)
