"""opdkit.tasks.evaluate: the share of right answers, and greedy accuracy (raw and forced, one process or a
rank's share) on the tiny world's held-out problems against completions decoded and counted here."""

from __future__ import annotations

import pytest
import torch

from opdkit import tasks
from opdkit.config import load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.models import load_model, load_tokenizer
from opdkit.rollout import engines, greedy
from opdkit.tasks import evaluate
from opdkit.tasks.evaluate import Accuracy, accuracy, fraction_correct

N = 24
TASK = tasks.get_task("tiny")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:teacher")


@pytest.fixture(scope="module")
def models():
    return {name: load_model(f"tiny:{name}", torch.float32, "cpu").eval() for name in ("teacher", "student")}


@pytest.fixture(scope="module")
def heldout():
    return TASK.heldout(N)


def right(completion: str, answer: str) -> bool:
    """The tiny task's grading, written out: the text after the last ';' is the answer."""
    return ";" in completion and completion.rpartition(";")[2].strip() == answer


def test_fraction_correct_skips_what_was_not_checked():
    assert fraction_correct([True, None, False, True]) == pytest.approx(2 / 3)
    assert fraction_correct(r["correct"] for r in [{"correct": 1}, {"correct": 0}]) == 0.5
    assert fraction_correct([None, None]) is None and fraction_correct([]) is None


@pytest.mark.parametrize("name", ["teacher", "student"])
def test_raw_accuracy_is_the_share_of_greedy_completions_the_task_grades_right(name, models, tok, heldout):
    model, (messages, answers) = models[name], heldout
    comps = greedy.greedy_completions(model, tok, messages, max_new_tokens=TASK.max_new_tokens)
    graded = [TASK.check(c, a) for c, a in zip(comps, answers)]
    assert graded == [right(c, a) for c, a in zip(comps, answers)]
    acc = accuracy(model, tok, TASK, messages, answers, max_new_tokens=TASK.max_new_tokens, batch_size=7)
    assert acc == Accuracy(sum(graded) / N, None, N)
    # the same through an explicit engine of the kit's loop
    engine = engines.HFEngine()
    again = accuracy(model, tok, TASK, messages, answers, max_new_tokens=TASK.max_new_tokens, engine=engine)
    assert again == acc


def test_the_teacher_is_right_where_the_student_mostly_is_not(models, tok, heldout):
    """The numbers above are not trivial: the two models score far apart."""
    messages, answers = heldout
    raw = {
        name: accuracy(m, tok, TASK, messages, answers, max_new_tokens=TASK.max_new_tokens).raw
        for name, m in models.items()
    }
    assert raw["teacher"] >= 0.9 and raw["student"] <= 0.6, raw


def test_forced_accuracy_grades_the_forced_completions(models, tok, heldout):
    """A budget of 20 tokens cuts most completions before their answer: forcing gives them one."""
    teacher, (messages, answers) = models["teacher"], heldout
    cut = greedy.greedy_completions(teacher, tok, messages, max_new_tokens=20)
    forced = greedy.forced_completions(teacher, tok, messages, cut, TASK)
    raw_n = sum(right(c, a) for c, a in zip(cut, answers))
    forced_n = sum(right(f, a) for f, a in zip(forced, answers))
    assert forced_n > raw_n
    acc = accuracy(teacher, tok, TASK, messages, answers, max_new_tokens=20, forced=True)
    assert acc == Accuracy(raw_n / N, forced_n / N, N)


@pytest.mark.parametrize("name", ["teacher", "student"])
def test_each_rank_counts_its_own_share_and_the_shares_sum_to_one_process(name, models, tok, heldout):
    """Without a process group each rank returns its own count over all N; rank r decodes r, r + 2, ..."""
    model, (messages, answers) = models[name], heldout
    comps = greedy.greedy_completions(model, tok, messages, max_new_tokens=TASK.max_new_tokens)
    kw = dict(max_new_tokens=TASK.max_new_tokens, forced=True)
    whole = accuracy(model, tok, TASK, messages, answers, **kw)
    shares = [accuracy(model, tok, TASK, messages, answers, world=2, rank=r, **kw) for r in (0, 1)]
    for r, share in enumerate(shares):
        assert share.n == N
        assert share.raw == pytest.approx(sum(right(comps[i], answers[i]) for i in range(r, N, 2)) / N)
    assert sum(s.raw for s in shares) == pytest.approx(whole.raw)
    assert sum(s.forced for s in shares) == pytest.approx(whole.forced)


def test_no_problems_give_no_accuracy(models, tok):
    assert accuracy(models["teacher"], tok, TASK, [], [], max_new_tokens=5) == Accuracy(None, None, 0)


def test_a_config_sets_the_budget_the_batch_forcing_and_precision(monkeypatch):
    """`configured_accuracy` hands `accuracy` the config's evaluation settings; `forced` and `bf16` given
    win over the config's, other keyword arguments pass through."""
    seen = []
    monkeypatch.setattr(
        evaluate, "accuracy", lambda *args, **kw: seen.append((args, kw)) or Accuracy(0.5, None, 2)
    )
    cfg = load_config(WhiteboxConfig, "tiny", {"eval_batch_size": 5, "forced_accuracy": True, "bf16": True})
    assert (
        evaluate.completion_budget(cfg) == cfg.rollout_max_new_tokens == 40
    )  # eval_max_new_tokens 0: rollout_max_new_tokens
    args = ("model", "tok", TASK, ["m"], ["a"])
    assert evaluate.configured_accuracy(cfg, *args, world=2, rank=1) == Accuracy(0.5, None, 2)
    evaluate.configured_accuracy(
        load_config(WhiteboxConfig, "tiny", {"eval_max_new_tokens": 12}), *args, forced=True, bf16=True
    )
    assert [a for a, _ in seen] == [args, args]
    common = dict(batch_size=5, enable_thinking=False)
    assert seen[0][1] == dict(max_new_tokens=40, forced=True, bf16=True, world=2, rank=1, **common)
    assert seen[1][1] == dict(
        max_new_tokens=12, forced=True, bf16=True, batch_size=256, enable_thinking=False
    )


def test_configured_accuracy_is_accuracy_with_those_settings(models, tok, heldout):
    messages, answers = heldout
    cfg = load_config(WhiteboxConfig, "tiny", {"eval_max_new_tokens": 20, "forced_accuracy": True})
    got = evaluate.configured_accuracy(cfg, models["teacher"], tok, TASK, messages, answers)
    assert got == accuracy(models["teacher"], tok, TASK, messages, answers, max_new_tokens=20, forced=True)
