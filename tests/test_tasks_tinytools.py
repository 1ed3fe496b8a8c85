"""The tiny tool world's task (opdkit.tasks.tinytools): its prompt streams (seeded, the held-out set apart),
reference answers, grading, the teacher transcript's messages as the tiny template renders them, the call
answered by the kit's calculator; and the shipped tiny student, which neither solves it nor calls the tool."""

from __future__ import annotations

import json

import pytest

from opdkit import models, tasks
from opdkit.build import tool_teacher
from opdkit.config import ConfigError
from opdkit.rollout.episodes import CORRECT, MALFORMED, TOOL_CORRECT
from opdkit.tasks import tinytools as task
from opdkit.tiny.tokenizer import IM_END, IM_START


def terms(prompt: str) -> list[int]:
    parts = prompt.split("+")
    assert len(parts) == 4 and all(len(p) == 3 and p.isdigit() and p[0] != "0" for p in parts), prompt
    return [int(p) for p in parts]


def test_it_is_registered_and_chosen_by_its_dataset_name():
    assert isinstance(tasks.get_task("tiny-tools"), task.TinyToolsTask)
    assert isinstance(tasks.for_dataset("tiny-tools"), task.TinyToolsTask)
    assert tasks.get_task("tiny-tools").tools[0]["function"]["name"] == "calculator"


def test_the_training_stream_is_seeded_and_its_answers_are_the_sums():
    t = task.TinyToolsTask()
    a, b = t.load_prompts("tiny-tools", subset_size=300, seed=1), t.load_prompts(subset_size=300, seed=1)
    assert a["messages"] == b["messages"] and a["answer"] == b["answer"]
    other = t.load_prompts(subset_size=300, seed=2)
    assert a["messages"] != other["messages"]
    for messages, answer in zip(a["messages"], a["answer"]):
        assert [m["role"] for m in messages] == ["user"]
        assert answer == str(sum(terms(messages[0]["content"])))
    assert len(t.load_prompts(subset_size=-1, seed=0)) == task.DEFAULT_SIZE
    with pytest.raises(ConfigError, match="subset_size"):
        t.load_prompts(subset_size=0)


def test_the_held_out_set_is_apart_from_training_streams_and_gradient_holdouts():
    t = task.TinyToolsTask()
    messages, answers = t.heldout(500)
    held = {m[0]["content"] for m in messages}
    assert len(held) == 500 and t.heldout(500) == (messages, answers)
    assert all(a == str(sum(terms(m[0]["content"]))) for m, a in zip(messages, answers))
    for seed in (0, 1, 42, 4321 - task.TRAINING_SEED_OFFSET):
        train = {m[0]["content"] for m in t.load_prompts(subset_size=2000, seed=seed)["messages"]}
        holdout = {m[0]["content"] for m in t.reserved_holdout(200, seed)["messages"]}
        assert not train & task.heldout_pool() and not holdout & task.heldout_pool() and not train & holdout
    with pytest.raises(ConfigError, match="at most"):
        t.heldout(task.HELDOUT_POOL + 1)


def test_the_answer_is_the_text_after_the_last_separator():
    t = task.TinyToolsTask()
    assert t.check(";2250", "2250") and t.check("9+9=18;x;2250 ", "2250")
    assert not t.check("2250", "2250") and not t.check(";225", "2250")
    assert t.extract_answer("no answer") is None and t.extract_answer(";") is None
    assert t.answer_start("ab;2250") == 3 and t.answer_start("2250") is None
    assert t.forced_prefix("1+2;4") == "1+2;" and t.forced_prefix("1+2") == "1+2;"


def test_a_teacher_transcript_renders_call_result_and_answer(tiny_tokenizer):
    p = task.Problem((390, 983, 105, 772))
    text = tiny_tokenizer.apply_chat_template(task.teacher_messages(p), tools=task.TOOLS, tokenize=False)
    assert text == (
        f"{IM_START}system\n<tools>\ncalculator(expression)\n</tools>{IM_END}\n"
        f"{IM_START}user\n390+983+105+772{IM_END}\n"
        f"{IM_START}assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "390+983+105+772"}}\n'
        f"</tool_call>{IM_END}\n"
        f"{IM_START}user\n<tool_response>\n2250\n</tool_response>{IM_END}\n"
        f"{IM_START}assistant\n;2250{IM_END}\n"
    )
    # the longest transcript fits the tiny models' 256 positions
    longest = task.teacher_messages(task.Problem((999, 999, 999, 999)))
    ids = tiny_tokenizer.apply_chat_template(longest, tools=task.TOOLS, return_dict=True)["input_ids"]
    assert 240 <= len(ids) <= 256


def test_the_calculator_answers_a_call_with_the_plain_integer_the_teacher_learned():
    # the tool is the kit's calculator; an integer sum comes back as the integer ("2250", never "2250.0"),
    # the text the teacher's transcripts (teacher_messages) show it
    from opdkit.tasks.calculator import CalculatorEnvironment, calculate

    for p in task.heldout_problems(50) + [
        task.Problem((999, 999, 999, 999)),
        task.Problem((100, 100, 100, 100)),
    ]:
        written = str(p.terms[0] + p.terms[1] + p.terms[2] + p.terms[3])
        assert calculate(p.prompt) == written == task.teacher_messages(p)[2]["content"]
    env = CalculatorEnvironment(task.TinyToolsTask())
    call = task.teacher_messages(task.Problem((390, 983, 105, 772)))[1]["tool_calls"][0]["function"]
    ep = env.start([{"role": "user", "content": "390+983+105+772"}], "2250")
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]})
    step = env.step(ep, f"<tool_call>\n{body}\n</tool_call>")
    assert step.messages == [{"role": "tool", "content": "2250"}] and step.metrics[MALFORMED] == 0
    env.step(ep, ";2250")
    assert env.grade(ep)[CORRECT] and env.grade(ep)[TOOL_CORRECT]


def test_the_shipped_student_neither_solves_it_nor_calls_the_tool():
    tok, student = models.load_tokenizer("tiny:student"), models.load_model("tiny:student")
    messages, answers = task.TinyToolsTask().heldout(64)
    acc = tool_teacher.tool_accuracy(student, tok, messages, answers)
    assert acc["called_tool"] == 0 and acc["tool_call_share"] == 0 and acc["correct"] <= 0.1
    firsts = tool_teacher.greedy_turn(student, tok, messages, task.MAX_TURN_TOKENS)
    assert not any("<tool_call>" in t or "tool" in t for t in firsts)
