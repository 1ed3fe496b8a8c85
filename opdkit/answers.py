"""Final answers in worked solutions: the content of the last \\boxed{}.

    extract_boxed(r"... so \\boxed{42}.")   # "42"

Reference answers are read with this (`opdkit.data.final_answer`); completions are judged by
`opdkit.mathcheck` (math-verify), which the `math` task (`opdkit.tasks`) uses.
"""

from __future__ import annotations


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
