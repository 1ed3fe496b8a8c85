"""opdkit.tasks.environment: the tool-call format (Qwen3's <tool_call> blocks) parsed from an assistant's
text, malformed calls answered with an error the model sees and counted, and an episode played by hand
against an environment of functions."""

from __future__ import annotations

from opdkit.rollout.episodes import CALLED_TOOL, CALLS, CORRECT, MALFORMED, TOOL_CORRECT, Episode
from opdkit.tasks.environment import (
    Call,
    NoTools,
    ToolEnvironment,
    ToolError,
    argument_error,
    final_text,
    parse_calls,
)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_well_formed_call_and_several_in_one_turn():
    one = parse_calls(
        "Let me compute. " + block('{"name": "calculator", "arguments": {"expression": "1+2"}}')
    )
    assert one == [Call("calculator", {"expression": "1+2"})]
    text = (
        block('{"name": "a", "arguments": {"x": 1}}')
        + "\nand\n"
        + block('  {"arguments": {"y": "z"},\n "name": "b"}  ')
        + block('{"name": "c", "arguments": "{\\"k\\": 2}"}')  # arguments as a JSON string
    )
    assert parse_calls(text) == [Call("a", {"x": 1}), Call("b", {"y": "z"}), Call("c", {"k": 2})]
    assert parse_calls("no call here: 42") == []


def test_malformed_calls_carry_an_error_and_nothing_is_raised():
    cases = {
        "bad json": block('{"name": "calculator", "arguments": {"expression": "1+2"'),
        "not an object": block('["calculator"]'),
        "no name": block('{"arguments": {"expression": "1"}}'),
        "arguments a list": block('{"name": "calculator", "arguments": [1, 2]}'),
        "arguments bad json string": block('{"name": "calculator", "arguments": "{oops"}'),
    }
    for what, text in cases.items():
        calls = parse_calls(text)
        assert len(calls) == 1 and calls[0].error, what
    # an unclosed block at the end is malformed too, after the good ones before it
    calls = parse_calls(
        block('{"name": "a", "arguments": {}}') + '<tool_call>\n{"name": "a", "arguments": {}}'
    )
    assert calls[0] == Call("a", {}) and calls[1].error and "unclosed" in calls[1].error


SCHEMA = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "say it back",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
            "required": ["text"],
        },
    },
}


def test_arguments_are_checked_against_the_schema():
    assert argument_error(SCHEMA, {"text": "hi"}) is None
    assert argument_error(SCHEMA, {"text": "hi", "times": 2}) is None
    assert "takes the arguments" in argument_error(SCHEMA, {})
    assert "takes the arguments" in argument_error(SCHEMA, {"text": "hi", "loud": True})
    assert "must be a string" in argument_error(SCHEMA, {"text": 3})
    assert "must be a integer" in argument_error(SCHEMA, {"text": "a", "times": True})


def echo(text: str, times: int = 1) -> str:
    if text == "boom":
        raise ToolError("cannot echo boom")
    return text * times


def test_an_episode_played_by_hand():
    env = ToolEnvironment({"echo": (SCHEMA, echo)}, check=lambda completion, answer: completion == answer)
    assert env.tools == [SCHEMA]
    ep = env.start([{"role": "user", "content": "say ab twice"}], answer="abab")
    assert isinstance(ep, Episode) and ep.turns == 0 and not ep.done

    turn1 = (
        block('{"name": "echo", "arguments": {"text": "ab", "times": 2}}')
        + block('{"name": "shout", "arguments": {"text": "ab"}}')  # unknown tool
        + block('{"name": "echo", "arguments": {"txt": "ab"}}')  # wrong argument
        + block('{"name": "echo", "arguments": {"text": "boom"}}')  # the tool's own error
        + block("{not json}")
    )
    step = env.step(ep, turn1)
    assert not step.done and step.metrics == {CALLS: 5, MALFORMED: 4}
    texts = [m["content"] for m in step.messages]
    assert [m["role"] for m in step.messages] == ["tool"] * 5
    assert texts[0] == "abab"
    assert texts[1].startswith("error: unknown tool 'shout'") and "echo" in texts[1]
    assert texts[2].startswith("error: echo takes the arguments")
    assert texts[3] == "error: cannot echo boom"
    assert texts[4].startswith("error: bad JSON")
    # the conversation holds the assistant's text as sampled, then the results
    assert ep.messages[1] == {"role": "assistant", "content": turn1} and ep.messages[2:] == step.messages

    step = env.step(ep, "abab")
    assert step.done and step.messages == [] and step.metrics == {} and ep.done
    assert final_text(ep) == "abab" and ep.turns == 2 and ep.metrics == {CALLS: 5, MALFORMED: 4}
    assert env.grade(ep) == {CORRECT: True, CALLED_TOOL: True, TOOL_CORRECT: False}  # malformed calls


def test_an_episode_cut_before_its_final_answer_is_not_correct():
    env = ToolEnvironment({"echo": (SCHEMA, echo)}, check=lambda completion, answer: True)
    ep = env.start([{"role": "user", "content": "x"}], answer="x")
    env.step(ep, block('{"name": "echo", "arguments": {"text": "x"}}'))
    assert env.grade(ep)[CORRECT] is False  # it never answered (cut at max_turns)


def test_without_tools_every_turn_is_the_answer():
    env = NoTools(check=lambda completion, answer: completion.strip() == answer)
    ep = env.start([{"role": "user", "content": "1+1"}], answer="2")
    step = env.step(ep, block('{"name": "calculator", "arguments": {"expression": "1+1"}}'))
    assert step.done and step.messages == [] and step.metrics == {} and env.tools == []
    assert ep.metrics == {} and env.grade(ep) == {CORRECT: False}  # a call is no final answer
    ep2 = env.start([{"role": "user", "content": "1+1"}], answer="2")
    env.step(ep2, " 2")
    assert env.grade(ep2) == {CORRECT: True}  # no tool metrics: they count 0
