"""The tiny world: task, tokenizer, shipped models (the recipe that built them: test_build_tiny_world.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opdkit import tiny
from opdkit.build import tiny_world as build
from opdkit.models import load_tokenizer
from opdkit.tasks import tiny as task


def test_scratchpads_are_valid_and_varied():
    rng = random.Random(0)
    p = task.Problem(358, 467)
    pads = {task.scratchpad(p, rng) for _ in range(200)}
    assert len(pads) > 10, "column order must vary"
    assert all(task.is_valid_scratchpad(p, s) for s in pads)
    assert task.scratchpad(p) == "8+7=15,5+6+1=12,3+4+1=8;825"
    assert task.is_correct(p, "8+7=15,6+5+1=12,1+3+4=8;825")
    assert not task.is_valid_scratchpad(p, "8+7=15,5+6=11,3+4+1=8;825")
    assert task.extract_answer("no answer") is None


def test_final_carry_makes_four_digits():
    p = task.Problem(999, 999)
    assert task.scratchpad(p).endswith(";1998")
    assert len(task.scratchpad(p)) + 1 <= task.MAX_COMPLETION_TOKENS


def test_heldout_problems_are_deterministic():
    assert task.heldout_problems(5) == task.heldout_problems(5)
    assert task.heldout_problems(5) != task.problems(5, seed=1)


def test_shipped_tokenizer_round_trips_and_has_no_bos():
    tok = AutoTokenizer.from_pretrained(tiny.resolve("tiny:tokenizer"))
    assert tok.bos_token is None and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "8+7=15,5+6+1=12;825"
    assert tok.decode(tok(text)["input_ids"]) == text
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "2+1=3;3"}],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "2+1=3;3<|im_end|>"


def test_shipped_models_are_small_qwen3_folders():
    total = sum(f.stat().st_size for f in tiny.ASSETS.rglob("*.safetensors"))
    assert total <= 10 * 2**20, f"tiny world weights are {total / 2**20:.1f} MB"
    for part in ("teacher", "student"):
        model = AutoModelForCausalLM.from_pretrained(tiny.resolve(f"tiny:{part}"))
        assert model.config.model_type == "qwen3"


def test_the_bpe_teacher_loads_and_reads_other_tokens_than_the_student():
    student, teacher = load_tokenizer("tiny:student"), load_tokenizer("tiny:teacher-bpe")
    model = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher-bpe"))
    assert model.config.model_type == "qwen3" and model.config.vocab_size == len(teacher)
    assert teacher.get_vocab() != student.get_vocab()
    text = "<|im_start|>assistant\n8+7=15,5+6+1=12;825<|im_end|>"
    s_ids, t_ids = student.encode(text), teacher.encode(text)
    assert teacher.decode(t_ids) == text and len(t_ids) < len(s_ids)
    assert (teacher.eos_token, teacher.pad_token) == (student.eos_token, student.pad_token)
    recorded = json.loads((tiny.ASSETS / "teacher-bpe" / "recipe.json").read_text())
    assert recorded["teacher_heldout_accuracy"] >= 0.95


def test_unknown_tiny_part_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="tiny:teacher, tiny:student"):
        tiny.resolve("tiny:professor")


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(tiny.resolve("tiny:tokenizer"), padding_side="left")


def test_teacher_is_accurate_and_student_is_not(tok):
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    t_acc = build.heldout_accuracy(teacher, tok, n=500)
    s_acc = build.heldout_accuracy(student, tok, n=500)
    recorded = json.loads((tiny.ASSETS / "recipe.json").read_text())
    assert t_acc >= 0.95 and s_acc <= 0.30, (t_acc, s_acc)
    assert t_acc == recorded["teacher_heldout_accuracy"] and s_acc == recorded["student_heldout_accuracy"]


def test_teacher_scratchpads_are_valid_and_vary_under_sampling(tok):
    from opdkit.rollout import sampling

    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    p = task.Problem(358, 467)
    ids, mask = sampling.encode_prompts(tok, [[{"role": "user", "content": p.prompt}]] * 32)
    torch.manual_seed(0)
    r = sampling.sample(
        teacher,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )
    comps = sampling.decode_completions(tok, r)
    assert sum(task.is_valid_scratchpad(p, c) for c in comps) >= 28
    assert len(set(comps)) >= 4, "the teacher spreads probability over column orders"


@pytest.mark.parametrize("seed", [0, 42, 1234 - 100_003])
def test_training_streams_leave_the_evaluation_pool_and_the_holdouts_out(seed):

    stream_seed = task.training_seed(seed)
    train = task.training_problems(20_000, stream_seed)
    plain = task.problems(20_000, stream_seed)
    assert not {p.prompt for p in train} & task.heldout_pool()  # problems() alone shares 13 with 500 at 42
    assert not any(task.in_holdout_class(p) for p in train)
    replaced = sum(a != b for a, b in zip(train, plain))
    assert 0 < replaced < 0.03 * len(train)  # the other positions keep their problems
    holdout = task.holdout_problems(1000, seed + 7_919)
    assert all(task.in_holdout_class(p) for p in holdout)
    assert not {p.prompt for p in holdout} & (task.heldout_pool() | {p.prompt for p in train})
    assert {p.prompt for p in task.heldout_problems(500)} <= task.heldout_pool()


def test_more_held_out_problems_than_the_pool_is_an_error():
    with pytest.raises(ValueError, match=f"only the first {task.HELDOUT_POOL}"):
        task.heldout_problems(task.HELDOUT_POOL + 1)
