"""opdkit.tasks.evaluate.episode_accuracy: greedy episodes with the calculator (the training rollouts' loop at
temperature 0) against episodes played and graded by hand here: each turn decoded greedily one token at a time
from the rendered conversation, the call read with `json`, the sum done in Python, the answer graded by its
text after ';'."""

from __future__ import annotations

import pytest
import torch
from helpers import tool_episode_by_hand as by_hand

from opdkit.models import load_model, load_tokenizer
from opdkit.rollout.episodes import TOOL_CORRECT
from opdkit.tasks import tinytools
from opdkit.tasks.calculator import CalculatorEnvironment
from opdkit.tasks.evaluate import episode_accuracy

N = 8
TASK = tinytools.TinyToolsTask()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:teacher-tools")


@pytest.fixture(scope="module")
def teacher():
    return load_model("tiny:teacher-tools", torch.float32, "cpu").eval()


def test_greedy_episodes_are_graded_as_by_hand(tok, teacher):
    messages, answers = TASK.heldout(N)
    # two references doctored: the episode's answer and its tool result no longer match them
    answers = [str(int(a) + 1) if i in (2, 5) else a for i, a in enumerate(answers)]
    env = CalculatorEnvironment(TASK)
    acc = episode_accuracy(
        teacher, tok, env, messages, answers, max_turns=2, max_new_tokens=tinytools.MAX_TURN_TOKENS
    )
    hand = [by_hand(teacher, tok, m[0]["content"], a) for m, a in zip(messages, answers)]
    assert acc.n == N
    assert acc.raw == sum(h[0] for h in hand) / N
    assert acc.tool_call_share == sum(h[1] for h in hand) / N
    assert acc.called_share == sum(h[2] for h in hand) / N == 1.0
    assert acc.raw <= (N - 2) / N and acc.tool_call_share <= (N - 2) / N and acc.raw >= (N - 3) / N
    # each rank of two plays its own share; the two shares add up to the whole
    halves = [
        episode_accuracy(
            teacher,
            tok,
            env,
            messages,
            answers,
            max_turns=2,
            max_new_tokens=110,
            world=2,
            rank=r,
            batch_size=3,
        )
        for r in (0, 1)
    ]
    assert sum(h.raw for h in halves) == pytest.approx(acc.raw)
    assert sum(h.tool_call_share for h in halves) == pytest.approx(acc.tool_call_share)


def test_the_shipped_student_neither_answers_nor_calls(tok):
    student = load_model("tiny:student", torch.float32, "cpu").eval()
    messages, answers = TASK.heldout(N)
    acc = episode_accuracy(
        student, tok, CalculatorEnvironment(TASK), messages, answers, max_turns=2, max_new_tokens=110
    )
    hand = [by_hand(student, tok, m[0]["content"], a) for m, a in zip(messages[:3], answers[:3])]
    assert hand == [(False, False, False)] * 3
    assert (acc.raw, acc.tool_call_share, acc.called_share) == (0.0, 0.0, 0.0)


def test_a_malformed_or_wrong_call_is_not_a_correct_call():
    from opdkit.tasks.environment import called_correctly

    env = CalculatorEnvironment(TASK)
    call = '<tool_call>\n{"name": "calculator", "arguments": {%s}}\n</tool_call>'
    cases = {  # the turn's text -> called correctly (reference 2250)
        call % '"expression": "390+983+105+772"': True,
        call % '"expression": "390+983+105+771"': False,  # well formed, the wrong sum
        call % '"expr": "390+983+105+772"': False,  # wrong argument
        call.replace("}}", "}") % '"expression": "390+983+105+772"': False,  # bad JSON
        ";2250": False,  # no call
    }
    for text, want in cases.items():
        ep = env.start([{"role": "user", "content": "390+983+105+772"}], "2250")
        env.step(ep, text)
        assert called_correctly(ep) is want, text
        assert env.grade(ep)[TOOL_CORRECT] is want
