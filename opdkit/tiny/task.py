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

import random
import re
from dataclasses import dataclass

N_DIGITS = 3
ANSWER_SEP = ";"
# Longest completion "9+9+1=19," x3 + ";1999" is 32 characters; one more for EOS, plus slack.
MAX_COMPLETION_TOKENS = 40


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


def heldout_problems(n: int, seed: int = 1234) -> list[Problem]:
    """Evaluation problems; the training streams use other seeds, so overlap is only by chance."""
    return problems(n, seed)


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
