"""The episode interface: what a multi-turn rollout (`opdkit.rollout.multiturn`) plays against, and what each
turn's answer carries. It sits below both the rollouts that consume it and the environments that implement it
(`opdkit.tasks.environment`: `ToolEnvironment`, `NoTools`; `opdkit.tasks.calculator`), as tinker-cookbook's
`rl/types.py` sits below its rollout loop.

    episode = env.start(messages, answer)       # an Episode: the conversation so far, its metrics
    result = env.step(episode, assistant_text)  # a StepResult: tool messages, done, metrics {CALLS: 1, ...}
    episode.metrics                             # its steps' metrics summed: {CALLS: 1.0, MALFORMED: 0.0}
    env.grade(episode)                          # the end's metrics: {CORRECT: True, CALLED_TOOL: True, ...}

Metrics are one flat mapping of names to numbers, summed wherever they meet: a step's
(`StepResult.metrics`), an episode's (its steps' summed, `Episode.metrics`), its grade's, and a rollout
step's (every episode's, with the rollouts' own `EPISODES`, `TURNS`, `TRUNCATED`: `MultiTurnRollouts.counts`).
A name an environment does not write counts 0. The names are written here, once; the trainer's `tool/`
columns and the evaluation's shares are computed from them (`MultiTurnRollouts.step_metrics`,
`opdkit.tasks.evaluate.episode_accuracy`).

`Environment.step` keeps the episode's books (the assistant's turn appended as sampled, the turn counted, the
answer's messages appended, its metrics added, `done` set); an environment writes only its answer (`respond`)
and its grade.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

# A step's (an environment's answer to one turn).
CALLS = "calls"  # the turn's tool calls
MALFORMED = "malformed"  # of them malformed: bad JSON, unknown tool, wrong arguments, a tool's error
# An episode's grade.
CORRECT = "correct"  # the final answer is right
CALLED_TOOL = "called_tool"  # at least one call
TOOL_CORRECT = "tool_correct"  # the tools called correctly (`opdkit.tasks.environment.called_correctly`)
# The rollouts' own.
EPISODES = "episodes"  # one per episode
TURNS = "turns"  # the student's sampled turns (a last turn cut by its token limit included)
TRUNCATED = "truncated"  # episodes cut by a token limit
# What a rollout step sums over its episodes and reports (`MultiTurnRollouts.counts`), in this order.
COUNTS = (EPISODES, CALLED_TOOL, TOOL_CORRECT, CALLS, MALFORMED, TURNS, CORRECT, TRUNCATED)


def add_metrics(total: dict[str, float], metrics: Mapping[str, float]) -> None:
    """Add `metrics` into `total`, name by name (a name `total` lacks starts at 0)."""
    for name, value in metrics.items():
        total[name] = total.get(name, 0.0) + value


@dataclass
class StepResult:
    """The environment's answer to one assistant turn: the tool messages to append (`[]` when done), whether
    the episode ended, and the turn's metrics (`CALLS`, `MALFORMED`; {} for none)."""

    messages: list[dict]
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Episode:
    """One prompt's conversation so far (the prompt, the assistant's turns as sampled, the tool results), its
    reference answer, the turns the environment read, and its steps' metrics summed."""

    messages: list[dict]
    answer: str
    turns: int = 0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


class Environment(ABC):
    """What a multi-turn rollout plays against. `tools`: the JSON schemas passed to
    `apply_chat_template(tools=...)` ([] for none)."""

    tools: list[dict] = []

    def start(self, messages: list[dict], answer: str) -> Episode:
        """A fresh episode from a prompt row (its conversation, copied, and reference answer)."""
        return Episode(messages=[dict(m) for m in messages], answer=answer)

    def step(self, episode: Episode, assistant_text: str) -> StepResult:
        """The assistant's turn (the text it sampled, without its stop token) played: appended to the
        episode, answered (`respond`), the answer's messages appended and its metrics added to the
        episode's; the answer."""
        episode.messages.append({"role": "assistant", "content": assistant_text})
        episode.turns += 1
        result = self.respond(episode, assistant_text)
        episode.messages.extend(result.messages)
        add_metrics(episode.metrics, result.metrics)
        episode.done = result.done
        return result

    @abstractmethod
    def respond(self, episode: Episode, assistant_text: str) -> StepResult:
        """The answer to the assistant's turn, which `episode` already ends with: tool results, or done."""

    @abstractmethod
    def grade(self, episode: Episode) -> dict[str, float]:
        """The metrics of an episode's end: `CORRECT`, and those of its own (a tool environment's
        `CALLED_TOOL`, `TOOL_CORRECT`)."""
