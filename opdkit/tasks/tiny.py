"""The tiny world's task: 3-digit addition with a column-by-column scratchpad.

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

import functools
import random
import re
import zlib
from dataclasses import dataclass

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


def problems(n: int, seed: int, n_digits: int = N_DIGITS) -> list[Problem]:
    """`n` problems drawn deterministically from `seed`."""
    rng = random.Random(seed)
    return [sample_problem(rng, n_digits) for _ in range(n)]


def heldout_problems(n: int, seed: int = HELDOUT_SEED) -> list[Problem]:
    """Evaluation problems: the first `n` of the `seed` stream. At the default seed they come from the
    reserved pool that training streams and gradient holdouts leave out, so `n` is at most HELDOUT_POOL."""
    if seed == HELDOUT_SEED and n > HELDOUT_POOL:
        raise ValueError(
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


def training_problems(n: int, seed: int, n_digits: int = N_DIGITS) -> list[Problem]:
    """`n` training problems from `seed`: `problems(n, seed)`, except that a problem held out for evaluation
    or in the gradient holdouts' class is replaced by the next fitting draw of a second stream, so the other
    positions keep their problems."""
    spare = random.Random(f"{seed}-replacement")
    out = []
    for p in problems(n, seed, n_digits):
        while p.prompt in heldout_pool() or in_holdout_class(p):
            p = sample_problem(spare, n_digits)
        out.append(p)
    return out


def holdout_problems(n: int, seed: int, n_digits: int = N_DIGITS) -> list[Problem]:
    """`n` gradient-holdout problems from `seed`: draws of the `seed` stream in the holdout class and not
    held out for evaluation, so apart from every training stream and every evaluation set by construction."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        p = sample_problem(rng, n_digits)
        if in_holdout_class(p) and p.prompt not in heldout_pool():
            out.append(p)
    return out


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
