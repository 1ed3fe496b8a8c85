"""opdkit.tasks.calculator: the calculator computes + - * / with parentheses exactly, refuses everything
else (names, attributes, calls, **, huge numbers, long input) with a message, quickly; its environment answers
calls and grades the final answer by the task."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from opdkit.rollout.episodes import CALLED_TOOL, CALLS, CORRECT, MALFORMED, TOOL_CORRECT
from opdkit.tasks import tiny
from opdkit.tasks.calculator import CALCULATOR, MAX_CHARS, CalculatorEnvironment, ToolError, calculate


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1+2*3", 7),
        ("(1+2)*3", 9),
        ("2*3+4*5", 26),
        ("10-4-3", 3),  # left to right
        ("10-(4-3)", 9),
        ("-3*4", -12),
        ("-(2+3)", -5),
        ("--5", 5),
        ("+7", 7),
        ("6/3", 2),
        ("7/2", Fraction(7, 2)),
        ("1/3", Fraction(1, 3)),
        ("0.1+0.2", Fraction(3, 10)),  # exact, not 0.30000000000000004
        ("2.5*4", 10),
        ("123*456", 56088),
        (" 345 + 678 + 912 + 101 ", 2036),
        ("(((1)))", 1),
        ("-7/2", Fraction(-7, 2)),
    ],
)
def test_it_computes_the_values_python_fractions_give(expression, value):
    want = Fraction(value)
    got = calculate(expression)
    if want.denominator == 1:
        assert got == str(want.numerator)
    else:  # a decimal within its last place
        assert abs(Fraction(got) - want) <= Fraction(1, 10**10)


@pytest.mark.parametrize(
    "expression, words",
    [
        ("__import__('os')", "not allowed"),
        ("x+1", "not allowed"),
        ("(1).real", "not allowed"),
        ("abs(-1)", "not allowed"),
        ("2**10", "**"),
        ("9**9**9", "**"),
        ("1e5", "not allowed"),  # no exponents
        ("0x10", "not allowed"),
        ("7//2", "not allowed"),
        ("1_000+1", "not allowed"),
        ("[1, 2]", "not allowed"),
        ("1 +", "not an arithmetic expression"),
        ("1..2", "not an arithmetic expression"),
        ("", "empty"),
        ("1/0", "division by zero"),
        ("1" * 31, "number too long"),
        ("+".join(["1"] * (MAX_CHARS // 2 + 1)), "too long"),
        ("*".join(["999999999999999999999999999999"] * 3), "result too large"),
    ],
)
def test_it_refuses_everything_else_with_a_message(expression, words):
    with pytest.raises(ToolError, match=None) as err:
        calculate(expression)
    assert words in str(err.value)


def test_huge_inputs_are_refused_fast():
    start = time.perf_counter()
    for text in ["9**9**9", "9" * 10_000, "(" * 150 + "1" + ")" * 150, "*".join(["9" * 29] * 6)]:
        with pytest.raises(ToolError):
            calculate(text)
    assert time.perf_counter() - start < 1.0


def test_the_schema_is_an_openai_function_with_one_string_argument():
    fn = CALCULATOR["function"]
    assert CALCULATOR["type"] == "function" and fn["name"] == "calculator"
    assert fn["parameters"]["properties"] == {"expression": fn["parameters"]["properties"]["expression"]}
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    assert fn["parameters"]["required"] == ["expression"]


def call(expression) -> str:
    import json

    return (
        "<tool_call>\n"
        + json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        + "\n</tool_call>"
    )


def test_an_episode_with_the_calculator():
    env = CalculatorEnvironment(tiny.TinyTask())
    assert env.tools == [CALCULATOR]
    ep = env.start([{"role": "user", "content": "358+467"}], answer="825")
    step = env.step(ep, call("358+467") + call("2**3") + call(5))
    assert step.metrics == {CALLS: 3, MALFORMED: 2} and not step.done
    assert step.messages[0] == {"role": "tool", "content": "825"}
    assert step.messages[1]["content"].startswith("error: ** is not allowed")
    assert step.messages[2]["content"] == "error: calculator's argument expression must be a string"
    step = env.step(ep, "8+7=15,5+6+1=12,3+4+1=8;825")
    assert step.done
    assert env.grade(ep) == {CORRECT: True, CALLED_TOOL: True, TOOL_CORRECT: False}  # two malformed calls
    assert ep.metrics == {CALLS: 3, MALFORMED: 2}
    wrong = env.start([{"role": "user", "content": "358+467"}], answer="825")
    env.step(wrong, ";826")
    assert env.grade(wrong) == {CORRECT: False, CALLED_TOOL: False, TOOL_CORRECT: False}
    assert wrong.metrics == {}
