"""The tiny world's task: 3-digit addition with a column-by-column scratchpad, its problem streams, prompts,
grading (exact match of the text after the last ';') and forced-answer cue (a ';' after the working).

    task = TinyTask(); task.check("8+7=15,5+6+1=12,3+4+1=8;825", "825")       # True
    ds = task.load_prompts("tiny", subset_size=256, seed=42)                    # a training stream
    messages, answers = task.heldout(500)                                       # the evaluation pool

    prompt      "358+467"
    completion  "8+7=15,5+6+1=12,3+4+1=8;825"

Each column of the scratchpad adds the two digits (and the carry, if any) from right to left; the
part after ``;`` is the answer. The terms of a column may be written in any order ("8+7" or "7+8";
"5+6+1", "1+6+5", ...), so one problem has between 8 and 6**3 = 216 valid scratchpads with the same
answer. That is why this task, and not a bare ``358+467=825``:

- sampling choices matter: the teacher spreads probability over the orders, so a student sampling
  on-policy writes completions that differ token by token, and the divergence is scored on all of them;
- antidistillation sampling has room to change a trace without changing its answer;
- the answer is exactly checkable, and the scratchpad is checkable line by line.

Three digits with carries keep the task out of reach of an under-trained tiny student (it writes the
format long before it carries correctly), while a ~1M-parameter teacher learns it almost perfectly.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opdkit.config import ConfigError
from opdkit.data import traces
from opdkit.tasks.base import Messages, Task

if TYPE_CHECKING:
    import datasets

DATASET = "tiny"  # the dataset_path that names the tiny world's own prompts
DEFAULT_SIZE = 1000  # training prompts of a stream when subset_size is -1

N_DIGITS = 3
ANSWER_SEP = ";"
# Longest completion "9+9+1=19," x3 + ";1999" is 32 characters; one more for EOS, plus slack.
MAX_COMPLETION_TOKENS = 40
HELDOUT_SEED = 1234
# Evaluation problems are the first of the HELDOUT_SEED stream, at most this many; no training stream
# (`training_problems`) and no gradient holdout (`holdout_problems`) holds one of them.
HELDOUT_POOL = 5000
# One problem in HOLDOUT_CLASS (by a CRC of its prompt) belongs to gradient holdouts (savegrad's), the
# others to training streams: the two never share a problem, whatever their seeds and sizes.
HOLDOUT_CLASS = 64
# Training prompts of the tiny world use seed + offset: far from the seeds the tiny-world build uses (0..3,
# 777) and from HELDOUT_SEED; `training_problems` leaves the evaluation pool out.
TRAINING_SEED_OFFSET = 100_003
# The gradient holdout is its own problem stream, apart from the training prompts other jobs draw with the
# same run seed (and from the evaluation seed): overlap is only by chance, and the holdout class excludes it.
HOLDOUT_SEED_OFFSET = 7_919


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def sample_problem(rng: random.Random, n_digits: int = N_DIGITS) -> Problem:
    lo, hi = 10 ** (n_digits - 1), 10**n_digits - 1
    return Problem(rng.randint(lo, hi), rng.randint(lo, hi))


class ProblemStreams:
    """A task's problem streams, drawn by `sample(rng, **sample_kw)` (a problem with a `prompt` and an
    `answer`): the first `heldout_size` of the `heldout_seed` stream are reserved for evaluation, one problem
    in `holdout_class` (by a CRC of its prompt) belongs to gradient holdouts, and training streams leave both
    out. The tiny task's are `STREAMS`; the tiny tool task has its own (`opdkit.tasks.tinytools`)."""

    def __init__(
        self, sample, heldout_seed: int, heldout_size: int, holdout_class: int, training_offset: int
    ):
        self.sample, self.heldout_seed, self.heldout_size = sample, heldout_seed, heldout_size
        self.holdout_class, self.training_offset = holdout_class, training_offset
        self._pool: frozenset[str] | None = None

    def problems(self, n: int, seed: int, **sample_kw) -> list:
        """`n` problems drawn deterministically from `seed`."""
        rng = random.Random(seed)
        return [self.sample(rng, **sample_kw) for _ in range(n)]

    def heldout_problems(self, n: int, seed: int | None = None) -> list:
        """Evaluation problems: the first `n` of the `seed` stream (default: the held-out seed). At the
        held-out seed they come from the reserved pool that training streams and gradient holdouts leave out,
        so `n` is at most its size."""
        seed = self.heldout_seed if seed is None else seed
        if seed == self.heldout_seed and n > self.heldout_size:
            raise ConfigError(
                f"{n} held-out problems asked for, but only the first {self.heldout_size} of the held-out "
                "stream are kept apart from training; ask for at most that many."
            )
        return self.problems(n, seed)

    def heldout_pool(self) -> frozenset[str]:
        """The prompts reserved for evaluation (every `heldout_problems(n)` is among them)."""
        if self._pool is None:
            self._pool = frozenset(p.prompt for p in self.problems(self.heldout_size, self.heldout_seed))
        return self._pool

    def in_holdout_class(self, problem) -> bool:
        """Does `problem` belong to the gradient holdouts' share of the problem space (1 in holdout_class)?"""
        return zlib.crc32(problem.prompt.encode()) % self.holdout_class == 0

    def training_problems(self, n: int, seed: int, **sample_kw) -> list:
        """`n` training problems from `seed`: `problems(n, seed)`, except that a problem held out for
        evaluation or in the gradient holdouts' class is replaced by the next fitting draw of a second
        stream, so the other positions keep their problems."""
        spare = random.Random(f"{seed}-replacement")
        out = []
        for p in self.problems(n, seed, **sample_kw):
            while p.prompt in self.heldout_pool() or self.in_holdout_class(p):
                p = self.sample(spare, **sample_kw)
            out.append(p)
        return out

    def holdout_problems(self, n: int, seed: int, **sample_kw) -> list:
        """`n` gradient-holdout problems from `seed`: draws of the `seed` stream in the holdout class and not
        held out for evaluation, so apart from every training stream and every evaluation set by
        construction."""
        rng, out = random.Random(seed), []
        while len(out) < n:
            p = self.sample(rng, **sample_kw)
            if self.in_holdout_class(p) and p.prompt not in self.heldout_pool():
                out.append(p)
        return out

    def training_seed(self, seed: int) -> int:
        """The seed of the training prompts for a run `seed`; never the held-out seed."""
        derived = seed + self.training_offset
        return derived + self.training_offset if derived == self.heldout_seed else derived


# The tiny task's streams (`problems(n, seed, n_digits=...)` and the training and holdout streams take the
# problems' digit count too).
STREAMS = ProblemStreams(sample_problem, HELDOUT_SEED, HELDOUT_POOL, HOLDOUT_CLASS, TRAINING_SEED_OFFSET)
problems, heldout_problems, heldout_pool = STREAMS.problems, STREAMS.heldout_problems, STREAMS.heldout_pool
in_holdout_class, training_problems = STREAMS.in_holdout_class, STREAMS.training_problems
holdout_problems, training_seed = STREAMS.holdout_problems, STREAMS.training_seed


def scratchpad(problem: Problem, rng: random.Random | None = None) -> str:
    """One valid worked solution; with `rng`, the terms of each column come in a random order."""
    da, db = str(problem.a)[::-1], str(problem.b)[::-1]
    carry, steps = 0, []
    for i in range(max(len(da), len(db))):
        terms = [int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0]
        if carry:
            terms.append(carry)
        if rng is not None:
            rng.shuffle(terms)
        total = sum(terms)
        steps.append("+".join(map(str, terms)) + f"={total}")
        carry = total // 10
    return ",".join(steps) + ANSWER_SEP + problem.answer


_STEP = re.compile(r"^(\d)\+(\d)(?:\+(\d))?=(\d{1,2})$")


def extract_answer(completion: str) -> str | None:
    """The text after the last ``;``, stripped, or None when there is none."""
    if ANSWER_SEP not in completion:
        return None
    return completion.rsplit(ANSWER_SEP, 1)[1].strip() or None


def implied_answer(completion: str) -> str | None:
    """The answer a scratchpad implies (its column sums' last digits read back, then the final carry);
    None when the working is malformed."""
    if ANSWER_SEP not in completion:
        return None
    sums = []
    for step in completion.rsplit(ANSWER_SEP, 1)[0].split(","):
        total = step.partition("=")[2]
        if not total.isdigit():
            return None
        sums.append(int(total))
    carry = str(sums[-1] // 10) if sums[-1] >= 10 else ""
    return carry + "".join(str(v % 10) for v in reversed(sums))


def is_correct(problem: Problem, completion: str) -> bool:
    """Exact match of the final answer."""
    return extract_answer(completion) == problem.answer


def is_valid_scratchpad(problem: Problem, completion: str) -> bool:
    """Every column holds the right terms (in any order) and the right sum, and the answer is right."""
    if not is_correct(problem, completion):
        return False
    work = completion.rsplit(ANSWER_SEP, 1)[0].split(",")
    da, db = str(problem.a)[::-1], str(problem.b)[::-1]
    carry = 0
    if len(work) != max(len(da), len(db)):
        return False
    for i, step in enumerate(work):
        m = _STEP.match(step)
        if not m:
            return False
        terms = [int(t) for t in m.groups()[:3] if t is not None]
        expected = [int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0]
        expected += [carry] if carry else []
        if sorted(terms) != sorted(expected) or int(m.group(4)) != sum(expected):
            return False
        carry = sum(expected) // 10
    return True


def prompt_rows(probs: list[Problem]) -> list[dict[str, Any]]:
    """Problems as prompt rows: `messages` (one user turn) and `answer` (no `datasets` needed)."""
    return [{"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in probs]


def training_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """The rows `TinyTask().load_prompts("tiny", subset_size=n, seed=seed)` holds, as a list."""
    return prompt_rows(training_problems(n, training_seed(seed)))


def as_dataset(probs: list[Problem]) -> datasets.Dataset:
    """Problems as a `datasets.Dataset` of prompts (`prompt_rows`)."""
    import datasets

    rows = prompt_rows(probs)
    return datasets.Dataset.from_dict(
        {"messages": [r["messages"] for r in rows], "answer": [r["answer"] for r in rows]}
    )


class StreamTask(Task):
    """A task whose prompts are its own `streams` (one user turn each) and whose answer is the text after the
    last ';': training streams (`load_prompts`), the evaluation pool (`heldout`) and gradient holdouts
    (`reserved_holdout`, the `seed + holdout_seed_offset` stream). The tiny task and the tiny tool task."""

    streams: ProblemStreams
    holdout_seed_offset: int = HOLDOUT_SEED_OFFSET
    default_size: int = DEFAULT_SIZE  # training prompts of a stream when subset_size is -1
    answer_cue = ANSWER_SEP
    has_heldout = True

    def load_prompts(
        self, path: str | None = None, split: str = "train", subset_size: int = -1, seed: int = 42
    ) -> datasets.Dataset:
        """A training stream of `subset_size` problems (-1: `default_size`) drawn from `seed`
        (`training_problems`: none of them held out for evaluation or in the gradient holdouts' class);
        `path` and `split` name the task's world and are otherwise unused."""
        if subset_size == 0 or subset_size < -1:
            raise ConfigError(f"subset_size={subset_size}; expected -1 (all) or a positive count.")
        n = self.default_size if subset_size == -1 else subset_size
        return as_dataset(self.streams.training_problems(n, self.streams.training_seed(seed)))

    def heldout(self, n: int, seed: int | None = None) -> tuple[list[Messages], list[str]]:
        """`n` held-out problems; `seed` draws another stream (a build's own evaluation uses one)."""
        probs = self.streams.heldout_problems(n) if seed is None else self.streams.problems(n, seed)
        return [[{"role": "user", "content": p.prompt}] for p in probs], [p.answer for p in probs]

    def reserved_holdout(self, n: int, seed: int) -> datasets.Dataset:
        """The gradient holdout's own share of problems (`holdout_problems`), apart from every training stream
        and the evaluation pool by construction; `n` -1 means `default_size`."""
        n = self.default_size if n == -1 else n
        return as_dataset(self.streams.holdout_problems(n, seed + self.holdout_seed_offset))

    def forced_prefix(self, completion: str) -> str:
        """The working before the completion's answer (all of it when it has none), then `;`: a finished
        completion's answer is written again (greedily: the same one), a cut one gets one."""
        at = completion.rfind(ANSWER_SEP)
        return (completion if at < 0 else completion[:at]) + self.answer_cue

    def check(self, completion: str, answer: str) -> bool:
        return extract_answer(completion) == answer

    def extract_answer(self, completion: str) -> str | None:
        return extract_answer(completion)

    def answer_start(self, completion: str) -> int | None:
        at = completion.rfind(ANSWER_SEP)
        return None if at < 0 else at + 1


class TinyTask(StreamTask):
    name = "tiny"
    max_new_tokens = MAX_COMPLETION_TOKENS
    forced_answer_tokens = 5  # up to 4 digits (999 + 999 = 1998), then EOS
    streams = STREAMS

    def error_kinds(self, records: Sequence[dict]) -> dict[str, float] | None:
        """The share of checked traces whose wrong answer follows from their own (mistaken) working, `slip`,
        and whose wrong answer contradicts it (or whose working is malformed), `contradiction`."""
        checked = [r for r in records if r["correct"] is not None]
        if not checked:
            return None
        wrong = [r for r in checked if not r["correct"]]
        texts = [traces.completion(r) for r in wrong]
        slips = sum(extract_answer(t) == implied_answer(t) for t in texts)
        return {"slip": slips / len(checked), "contradiction": (len(wrong) - slips) / len(checked)}
