"""Final answers in math completions: the last \\boxed{}, else an `Answer:` line, lightly normalised.

    extract_math_answer(r"... so \\boxed{42}.")   # "42"

The `math` task (`opdkit.tasks`) checks completions with these.
"""

from __future__ import annotations

import re


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def normalize_math_answer(ans: str) -> str:
    """Light normalisation for exact match: no spaces, no ``$``, no trailing ``.0``; ``\\frac`` kept."""
    ans = ans.strip().strip("$").replace(" ", "").replace("\\!", "").rstrip(".")
    ans = re.sub(r"\\text\{(.*?)\}", r"\1", ans)
    ans = re.sub(r"^(-?\d+)\.0+$", r"\1", ans)
    return ans.replace("dfrac", "frac").replace("tfrac", "frac")


_ANSWER_LINE = re.compile(r"Answer:\s*(.+?)\s*$", re.MULTILINE)


def extract_math_answer(text: str) -> str | None:
    r"""The last ``\boxed{...}``, else the last ``Answer: ...`` line (the DAPO-Math-17k format)."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    return lines[-1] if lines else None


def boxed_match(completion: str, ground_truth: str) -> bool:
    """Exact match after light normalisation of the boxed (or `Answer:`) answer."""
    got = extract_math_answer(completion)
    return got is not None and normalize_math_answer(got) == normalize_math_answer(str(ground_truth))
