"""The environments a multi-turn episode plays against (the interface: `opdkit.rollout.episodes`): a tool
environment of Python functions (`ToolEnvironment`; the calculator's is one file,
`opdkit/tasks/calculator.py`), and `NoTools`, where every turn is the final answer. Here are the tool calls'
format, their parsing and their answers, and the grading.

    env = CalculatorEnvironment(task)                           # tools: [CALCULATOR], JSON schemas
    ep = env.start([{"role": "user", "content": "What is 12*34?"}], answer="408")
    call = '{"name": "calculator", "arguments": {"expression": "12*34"}}'
    result = env.step(ep, f"<tool_call>\\n{call}\\n</tool_call>")
    result.messages  # [{"role": "tool", "content": "408"}]; result.done False, result.metrics {CALLS: 1, ...}
    result = env.step(ep, "408")                                # no call: the final answer, done
    env.grade(ep)    # {CORRECT: True, CALLED_TOOL: True, TOOL_CORRECT: True}; ep.metrics {CALLS: 1.0, ...}

The format is Qwen3's, as transformers, vLLM and Qwen3 render it: an assistant turn calls a tool with blocks
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in its text; a result is the message
`{"role": "tool", "content": ...}`; tools are JSON schemas (OpenAI's function format) passed as
`apply_chat_template(messages, tools=env.tools)`. A malformed call (bad JSON, unknown tool, wrong arguments,
a tool's own error) is answered with a short error text the model sees, counted (`MALFORMED`), never raised.
The episode keeps the assistant's turns as the text it sampled (`content`), so rendering the conversation
again gives the student's own text back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from opdkit.rollout.episodes import (
    CALLED_TOOL,
    CALLS,
    CORRECT,
    MALFORMED,
    TOOL_CORRECT,
    Environment,
    Episode,
    StepResult,
)

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class Call:
    """One parsed tool call, or the error that replaced it (`error`: the message the model sees instead of a
    result)."""

    name: str | None
    arguments: dict | None
    error: str | None = None


def parse_calls(text: str) -> list[Call]:
    """Every <tool_call>...</tool_call> block of an assistant turn, in order, parsed: a JSON object with a
    string `name` and an object `arguments` (a JSON string holding an object is read too, as some models
    write it). Bad JSON, no name or arguments of another shape give a `Call` with `error`; so does an unclosed
    block at the end of the text."""
    calls, at = [], 0
    while True:
        start = text.find(TOOL_CALL_OPEN, at)
        if start < 0:
            return calls
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            calls.append(Call(None, None, f"unclosed {TOOL_CALL_OPEN}: end the call with {TOOL_CALL_CLOSE}"))
            return calls
        calls.append(_parse_one(text[body_start:end]))
        at = end + len(TOOL_CALL_CLOSE)


def _parse_one(body: str) -> Call:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return Call(None, None, 'bad JSON in the tool call: write {"name": ..., "arguments": {...}}')
    if not isinstance(obj, dict):
        return Call(None, None, 'the tool call must be a JSON object: {"name": ..., "arguments": {...}}')
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return Call(None, None, 'the tool call has no "name"')
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return Call(name, None, f'bad JSON in the arguments of {name}: "arguments" must be an object')
    if not isinstance(arguments, dict):
        return Call(name, None, f"the arguments of {name} must be a JSON object")
    return Call(name, arguments)


def called_correctly(episode: Episode) -> bool:
    """Did the episode call its tools correctly: at least one call, none malformed (every call well formed
    and answered by its tool, no error), and one of the tools' results, stripped, is the reference answer
    (for the calculator: it was asked for the whole computation). The final answer is not looked at."""
    results = [str(m.get("content") or "").strip() for m in episode.messages if m.get("role") == "tool"]
    calls, malformed = episode.metrics.get(CALLS, 0), episode.metrics.get(MALFORMED, 0)
    return calls > 0 and malformed == 0 and str(episode.answer).strip() in results


def final_text(episode: Episode) -> str:
    """The last assistant turn's text (the final answer of a finished episode); "" without one."""
    texts = [m.get("content") or "" for m in episode.messages if m.get("role") == "assistant"]
    return texts[-1] if texts else ""


Tool = Callable[..., str]


class ToolEnvironment(Environment):
    """An environment of functions: each tool a JSON schema and a Python function taking its arguments by name
    and returning the result text (raising `ToolError` with the message the model sees). A turn without a call
    ends the episode, its text the final answer, graded by `check(final text, answer)`."""

    def __init__(self, functions: dict[str, tuple[dict, Tool]], check: Callable[[str, str], bool]):
        self.functions, self.check = functions, check
        self.tools = [schema for schema, _ in functions.values()]

    def respond(self, episode: Episode, assistant_text: str) -> StepResult:
        calls = parse_calls(assistant_text)
        if not calls:
            return StepResult(messages=[], done=True)
        out, malformed = [], 0
        for call in calls:
            text, ok = self._answer(call)
            malformed += not ok
            out.append({"role": "tool", "content": text})
        return StepResult(messages=out, done=False, metrics={CALLS: len(calls), MALFORMED: malformed})

    def _answer(self, call: Call) -> tuple[str, bool]:
        """(the tool message's text, whether the call was well formed and ran)."""
        if call.error is not None:
            return f"error: {call.error}", False
        if call.name not in self.functions:
            known = ", ".join(self.functions) or "none"
            return f"error: unknown tool {call.name!r}; the tools are: {known}", False
        schema, fn = self.functions[call.name]
        wrong = argument_error(schema, call.arguments or {})
        if wrong:
            return f"error: {wrong}", False
        try:
            return fn(**call.arguments), True
        except ToolError as e:
            return f"error: {e}", False

    def grade(self, episode: Episode) -> dict[str, float]:
        finished = episode.done and episode.turns > 0
        return {
            CORRECT: bool(finished and self.check(final_text(episode), episode.answer)),
            CALLED_TOOL: episode.metrics.get(CALLS, 0) > 0,
            TOOL_CORRECT: called_correctly(episode),
        }


class ToolError(ValueError):
    """A tool refused its input; the message is what the model sees."""


_JSON_TYPES = {
    "string": str,
    "number": (int, float),
    "integer": int,
    "boolean": bool,
    "object": dict,
    "array": list,
}


def argument_error(schema: dict, arguments: dict) -> str | None:
    """What is wrong with `arguments` for a tool's JSON `schema` (missing or unknown names, wrong JSON types);
    None when they fit."""
    fn = schema.get("function", schema)
    params = fn.get("parameters", {})
    props, required = params.get("properties", {}), params.get("required", [])
    name = fn.get("name", "the tool")
    want = ", ".join(f"{k} ({v.get('type', 'any')})" for k, v in props.items()) or "none"
    missing = [k for k in required if k not in arguments]
    unknown = [k for k in arguments if k not in props]
    if missing or unknown:
        return f"{name} takes the arguments {want}"
    for k, v in arguments.items():
        kind = _JSON_TYPES.get(props[k].get("type", ""))
        if kind is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
            return f"{name}'s argument {k} must be a {props[k]['type']}"
    return None


@dataclass
class NoTools(Environment):
    """No tools: every turn is the final answer (a single-turn episode), graded by `check`."""

    check: Callable[[str, str], bool] = field(default=lambda completion, answer: False)
    tools: list[dict] = field(default_factory=list)

    def respond(self, episode: Episode, assistant_text: str) -> StepResult:
        return StepResult(messages=[], done=True)

    def grade(self, episode: Episode) -> dict[str, float]:
        return {CORRECT: bool(episode.done and self.check(final_text(episode), episode.answer))}
