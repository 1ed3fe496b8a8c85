"""Environments: what answers a student's turn in a multi-turn episode (a tool's output), when the episode
ends, and how it is graded. The rollout source (`opdkit.rollout.multiturn`) plays episodes against one; a
tool environment is one file in `opdkit/tasks/` (`calculator.py`).

    env = CalculatorEnvironment(task)                           # tools: [CALCULATOR], JSON schemas
    ep = env.start([{"role": "user", "content": "What is 12*34?"}], answer="408")
    call = '{"name": "calculator", "arguments": {"expression": "12*34"}}'
    step = env.step(ep, f"<tool_call>\\n{call}\\n</tool_call>")
    step.messages    # [{"role": "tool", "content": "408"}]; step.done False, step.calls 1, step.malformed 0
    step = env.step(ep, "408")                                  # no call: the final answer, done
    env.grade(ep)    # {"correct": True, "called_tool": True, "tool_correct": True, "calls": 1, ...}

The format is Qwen3's, as transformers, vLLM and Qwen3 render it: an assistant turn calls a tool with blocks
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` in its text; a result is the message
`{"role": "tool", "content": ...}`; tools are JSON schemas (OpenAI's function format) passed as
`apply_chat_template(messages, tools=env.tools)`. A malformed call (bad JSON, unknown tool, wrong arguments,
a tool's own error) is answered with a short error text the model sees, counted, never raised. The episode
keeps the assistant's turns as the text it sampled (`content`), so rendering the conversation again gives
the student's own text back.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class Step:
    """What the environment answers to one assistant turn: the tool messages to append (`[]` when done), and
    the turn's tool calls, of them `malformed` (bad JSON, unknown tool, wrong arguments, a tool's error)."""

    messages: list[dict]
    done: bool
    calls: int = 0
    malformed: int = 0


@dataclass
class Episode:
    """One prompt's conversation so far (the prompt, the assistant's turns as sampled, the tool results) and
    its counts."""

    messages: list[dict]
    answer: str
    turns: int = 0
    calls: int = 0
    malformed: int = 0
    done: bool = False


class Environment(ABC):
    """What a multi-turn rollout plays against. `tools`: the JSON schemas passed to
    `apply_chat_template(tools=...)` ([] for none)."""

    tools: list[dict] = []

    @abstractmethod
    def start(self, messages: list[dict], answer: str) -> Episode:
        """A fresh episode from a prompt row (its conversation and reference answer)."""

    @abstractmethod
    def step(self, episode: Episode, assistant_text: str) -> Step:
        """The assistant's turn (the text it sampled, without its stop token) -> the tool results."""

    @abstractmethod
    def grade(self, episode: Episode) -> dict:
        """{"correct", "called_tool", "tool_correct", "calls", "malformed"} of an episode (`tool_correct`:
        `called_correctly`)."""


def called_correctly(episode: Episode) -> bool:
    """Did the episode call its tools correctly: at least one call, none malformed (every call well formed
    and answered by its tool, no error), and one of the tools' results, stripped, is the reference answer
    (for the calculator: it was asked for the whole computation). The final answer is not looked at."""
    results = [str(m.get("content") or "").strip() for m in episode.messages if m.get("role") == "tool"]
    return episode.calls > 0 and episode.malformed == 0 and str(episode.answer).strip() in results


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

    def start(self, messages: list[dict], answer: str) -> Episode:
        return Episode(messages=[dict(m) for m in messages], answer=answer)

    def step(self, episode: Episode, assistant_text: str) -> Step:
        calls = parse_calls(assistant_text)
        episode.messages.append({"role": "assistant", "content": assistant_text})
        episode.turns += 1
        if not calls:
            episode.done = True
            return Step(messages=[], done=True)
        out, malformed = [], 0
        for call in calls:
            text, ok = self._answer(call)
            malformed += not ok
            out.append({"role": "tool", "content": text})
        episode.calls += len(calls)
        episode.malformed += malformed
        episode.messages.extend(out)
        return Step(messages=out, done=False, calls=len(calls), malformed=malformed)

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

    def grade(self, episode: Episode) -> dict:
        finished = episode.done and episode.turns > 0
        return {
            "correct": bool(finished and self.check(final_text(episode), episode.answer)),
            "called_tool": episode.calls > 0,
            "tool_correct": called_correctly(episode),
            "calls": episode.calls,
            "malformed": episode.malformed,
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

    def start(self, messages: list[dict], answer: str) -> Episode:
        return Episode(messages=[dict(m) for m in messages], answer=answer)

    def step(self, episode: Episode, assistant_text: str) -> Step:
        episode.messages.append({"role": "assistant", "content": assistant_text})
        episode.turns += 1
        episode.done = True
        return Step(messages=[], done=True)

    def grade(self, episode: Episode) -> dict:
        correct = episode.done and self.check(final_text(episode), episode.answer)
        return {
            "correct": bool(correct),
            "called_tool": False,
            "tool_correct": False,
            "calls": 0,
            "malformed": 0,
        }
