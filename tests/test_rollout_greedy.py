"""Raw and forced accuracy (opdkit/rollout/greedy.py): a completion cut before its answer is graded on the
answer forced after the task's cue; a finished greedy completion forced again keeps its answer."""

from __future__ import annotations

import pytest

from opdkit import tasks
from opdkit.models import load_model, load_tokenizer
from opdkit.rollout import greedy as evaluate
from opdkit.tasks.evaluate import accuracy


@pytest.fixture(scope="module")
def teacher():
    return load_model("tiny:teacher").eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:teacher")


def test_forcing_answers_a_cut_completion_and_keeps_a_finished_one(teacher, tok):
    task = tasks.get_task("tiny")
    messages, answers = task.heldout(24)
    full = evaluate.greedy_completions(teacher, tok, messages, max_new_tokens=task.max_new_tokens)
    cut = evaluate.greedy_completions(teacher, tok, messages, max_new_tokens=20)  # mostly before the ';'
    forced_cut = evaluate.forced_completions(teacher, tok, messages, cut, task, batch_size=7)
    for f, c in zip(forced_cut, cut):
        assert f.startswith(c.rpartition(";")[0] or c) and ";" in f[len(c.rpartition(";")[0] or c) :]
    raw_n = sum(task.check(c, a) for c, a in zip(cut, answers))
    forced_n = sum(task.check(f, a) for f, a in zip(forced_cut, answers))
    assert forced_n >= raw_n + 4, (raw_n, forced_n)  # forcing answers cut completions, many right
    forced_full = evaluate.forced_completions(teacher, tok, messages, full, task)
    assert [task.extract_answer(f) for f in forced_full] == [task.extract_answer(c) for c in full]
    acc = accuracy(teacher, tok, task, messages, answers, max_new_tokens=20, batch_size=256, forced=True)
    raw, forced = acc.raw, acc.forced
    assert (raw, forced) == (raw_n / 24, forced_n / 24)


def test_the_math_cue_is_the_references_and_its_forced_box_is_graded():
    task = tasks.get_task("math")
    prefix = task.forced_prefix("so 6*7 = 41, hmm")
    assert prefix.endswith("\n\n**Final Answer**\n\\[\\boxed{")
    assert task.check(prefix + "42}\\]", "42") and not task.check("so 6*7 = 41, hmm", "42")
    assert not task.check(
        r"\boxed{42} wait" + task.forced_prefix("") + "41}\\]", "42"
    )  # the forced one counts


def test_forcing_needs_one_completion_per_prompt(teacher, tok):
    with pytest.raises(ValueError, match="one per prompt"):
        evaluate.forced_completions(
            teacher, tok, [[{"role": "user", "content": "1+2"}]], [], tasks.get_task("tiny")
        )
