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

import functools
import random
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opdkit.config import ConfigError
from opdkit.tasks.base import Messages, Task
from opdkit.tasks.calculator import CALCULATOR

if TYPE_CHECKING:
    import datasets

DATASET = "tiny-tools"  # the dataset_path that names the tiny tool world's own prompts
DEFAULT_SIZE = 1000  # training prompts of a stream when subset_size is -1

N_TERMS, N_DIGITS = 4, 3
ANSWER_SEP = ";"
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


def problems(n: int, seed: int) -> list[Problem]:
    """`n` problems drawn deterministically from `seed`."""
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def heldout_problems(n: int, seed: int = HELDOUT_SEED) -> list[Problem]:
    """Evaluation problems: the first `n` of the `seed` stream; at the default seed from the reserved pool
    that training streams and gradient holdouts leave out, so `n` is at most HELDOUT_POOL."""
    if seed == HELDOUT_SEED and n > HELDOUT_POOL:
        raise ConfigError(
            f"{n} held-out problems asked for, but only the first {HELDOUT_POOL} of the held-out stream are "
            "kept apart from training; ask for at most that many."
        )
    return problems(n, seed)


@functools.cache
def heldout_pool() -> frozenset[str]:
    """The prompts reserved for evaluation (every `heldout_problems(n)` is among them)."""
    return frozenset(p.prompt for p in problems(HELDOUT_POOL, HELDOUT_SEED))


def in_holdout_class(problem: Problem) -> bool:
    """Does `problem` belong to the gradient holdouts' share of the problem space (1 in HOLDOUT_CLASS)?"""
    return zlib.crc32(problem.prompt.encode()) % HOLDOUT_CLASS == 0


def training_problems(n: int, seed: int) -> list[Problem]:
    """`n` training problems from `seed`: `problems(n, seed)`, a problem held out for evaluation or in the
    gradient holdouts' class replaced by the next fitting draw of a second stream."""
    spare = random.Random(f"{seed}-replacement")
    out = []
    for p in problems(n, seed):
        while p.prompt in heldout_pool() or in_holdout_class(p):
            p = sample_problem(spare)
        out.append(p)
    return out


def holdout_problems(n: int, seed: int) -> list[Problem]:
    """`n` gradient-holdout problems from `seed`: draws in the holdout class, not held out for evaluation."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        p = sample_problem(rng)
        if in_holdout_class(p) and p.prompt not in heldout_pool():
            out.append(p)
    return out


def training_seed(seed: int) -> int:
    """The seed of the training prompts for a run `seed`; never the held-out seed."""
    derived = seed + TRAINING_SEED_OFFSET
    return derived + TRAINING_SEED_OFFSET if derived == HELDOUT_SEED else derived


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


def extract_answer(completion: str) -> str | None:
    """The text after the last ``;``, stripped, or None when there is none."""
    if ANSWER_SEP not in completion:
        return None
    return completion.rsplit(ANSWER_SEP, 1)[1].strip() or None


def prompt_rows(probs: list[Problem]) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in probs]


def as_dataset(probs: list[Problem]) -> datasets.Dataset:
    import datasets

    rows = prompt_rows(probs)
    return datasets.Dataset.from_dict(
        {"messages": [r["messages"] for r in rows], "answer": [r["answer"] for r in rows]}
    )


class TinyToolsTask(Task):
    """Four-term sums with a calculator. Its prompts are one user turn each; `tools` is what the chat template
    lists (`apply_chat_template(..., tools=task.tools)`); graded on the final assistant turn."""

    name = "tiny-tools"
    max_new_tokens = MAX_TURN_TOKENS  # per assistant turn
    answer_cue = ANSWER_SEP
    forced_answer_tokens = 5  # up to 4 digits (4 x 999 = 3996), then EOS
    has_heldout = True
    tools = TOOLS

    def load_prompts(
        self, path: str = DATASET, split: str = "train", subset_size: int = -1, seed: int = 42
    ) -> datasets.Dataset:
        """A training stream of `subset_size` problems (-1: DEFAULT_SIZE) drawn from `seed`, none of them held
        out for evaluation or in the gradient holdouts' class; `path` and `split` are otherwise unused."""
        if subset_size == 0 or subset_size < -1:
            raise ConfigError(f"subset_size={subset_size}; expected -1 (all) or a positive count.")
        n = DEFAULT_SIZE if subset_size == -1 else subset_size
        return as_dataset(training_problems(n, training_seed(seed)))

    def heldout(self, n: int, seed: int | None = None) -> tuple[list[Messages], list[str]]:
        """`n` held-out problems; `seed` draws another stream (a build's own evaluation uses one)."""
        probs = heldout_problems(n) if seed is None else problems(n, seed)
        return [[{"role": "user", "content": p.prompt}] for p in probs], [p.answer for p in probs]

    def reserved_holdout(self, n: int, seed: int) -> datasets.Dataset:
        return as_dataset(holdout_problems(DEFAULT_SIZE if n == -1 else n, seed + HOLDOUT_SEED_OFFSET))

    def forced_prefix(self, completion: str) -> str:
        at = completion.rfind(ANSWER_SEP)
        return (completion if at < 0 else completion[:at]) + self.answer_cue

    def check(self, completion: str, answer: str) -> bool:
        return extract_answer(completion) == answer

    def extract_answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def answer_start(self, completion: str) -> int | None:
        at = completion.rfind(ANSWER_SEP)
        return None if at < 0 else at + 1
