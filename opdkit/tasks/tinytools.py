"""The tiny tool world's task: sums of four 3-digit numbers, with a calculator to call. Its problem streams,
prompts, the calculator's schema, the messages of a teacher's transcript and grading (exact match of the text
after the last ';', as the tiny task).

    task = TinyToolsTask(); task.check(";2250", "2250")                       # True
    ds = task.load_prompts("tiny-tools", subset_size=256, seed=42)            # a training stream
    messages, answers = task.heldout(500)                                     # the evaluation pool
    tok.apply_chat_template(messages[0], tools=task.tools, add_generation_prompt=True)

    user        "390+983+105+772"
    assistant   <tool_call>{"name": "calculator", "arguments": {"expression": "390+983+105+772"}}</tool_call>
    tool        "2250"
    assistant   ";2250"

(`teacher_messages`; the tiny template renders the call and the result, `opdkit.tiny.tokenizer`.) The tiny
student, trained on two-term sums with a column scratchpad, writes its scratchpad and gets four terms wrong;
a teacher that calls the calculator and copies its result is right (`opdkit.build.tool_teacher`).

The tool is the kit's calculator (`opdkit.tasks.calculator`: `CALCULATOR`, answered by `calculate`, never
`eval`; a sum of integers comes back as the plain integer, "2250"); calls are read by
`opdkit.tasks.environment.parse_calls` and episodes played against `CalculatorEnvironment(TinyToolsTask())`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from opdkit.tasks import tiny
from opdkit.tasks.base import Messages
from opdkit.tasks.calculator import CALCULATOR

DATASET = "tiny-tools"  # the dataset_path that names the tiny tool world's own prompts
DEFAULT_SIZE = 1000  # training prompts of a stream when subset_size is -1

N_TERMS, N_DIGITS = 4, 3
ANSWER_SEP = tiny.ANSWER_SEP
# The longest assistant turn is the call: '<tool_call>\n{"name": "calculator", "arguments": {"expression":
# "999+999+999+999"}}\n</tool_call>' is 95 characters, one more for EOS, plus slack.
MAX_TURN_TOKENS = 110
HELDOUT_SEED = 4321
HELDOUT_POOL = 5000  # evaluation problems: the first of the HELDOUT_SEED stream, kept out of training
HOLDOUT_CLASS = 64  # one problem in this many (by a CRC of its prompt) belongs to gradient holdouts
TRAINING_SEED_OFFSET = 200_003
HOLDOUT_SEED_OFFSET = 7_919

TOOLS = [CALCULATOR]


@dataclass(frozen=True)
class Problem:
    terms: tuple[int, ...]

    @property
    def prompt(self) -> str:
        return "+".join(map(str, self.terms))

    @property
    def answer(self) -> str:
        return str(sum(self.terms))


def sample_problem(rng: random.Random, n_terms: int = N_TERMS, n_digits: int = N_DIGITS) -> Problem:
    lo, hi = 10 ** (n_digits - 1), 10**n_digits - 1
    return Problem(tuple(rng.randint(lo, hi) for _ in range(n_terms)))


# Its problem streams: the tiny task's machinery (`tiny.ProblemStreams`) over four-term sums.
STREAMS = tiny.ProblemStreams(sample_problem, HELDOUT_SEED, HELDOUT_POOL, HOLDOUT_CLASS, TRAINING_SEED_OFFSET)
problems, heldout_problems, heldout_pool = STREAMS.problems, STREAMS.heldout_problems, STREAMS.heldout_pool
in_holdout_class, training_problems = STREAMS.in_holdout_class, STREAMS.training_problems
holdout_problems, training_seed = STREAMS.holdout_problems, STREAMS.training_seed


def tool_call(expression: str) -> dict:
    """The assistant's call of the calculator, as chat messages carry it (transformers' convention)."""
    name = CALCULATOR["function"]["name"]
    return {"type": "function", "function": {"name": name, "arguments": {"expression": expression}}}


def teacher_messages(problem: Problem) -> Messages:
    """A teacher's transcript: the prompt, the calculator called on it, its result, the final answer."""
    return [
        {"role": "user", "content": problem.prompt},
        {"role": "assistant", "content": "", "tool_calls": [tool_call(problem.prompt)]},
        {"role": "tool", "content": problem.answer},
        {"role": "assistant", "content": ANSWER_SEP + problem.answer},
    ]


extract_answer = tiny.extract_answer  # the text after the last ';', as the tiny task


class TinyToolsTask(tiny.StreamTask):
    """Four-term sums with a calculator. Its prompts are one user turn each; `tools` is what the chat template
    lists (`apply_chat_template(..., tools=task.tools)`); graded on the final assistant turn (the tiny task's
    streams and grading, `tiny.StreamTask`)."""

    name = "tiny-tools"
    max_new_tokens = MAX_TURN_TOKENS  # per assistant turn
    forced_answer_tokens = 5  # up to 4 digits (4 x 999 = 3996), then EOS
    streams = STREAMS
    holdout_seed_offset = HOLDOUT_SEED_OFFSET
    default_size = DEFAULT_SIZE
    tools = TOOLS
