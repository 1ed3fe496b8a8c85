"""Math answers judged by math-verify, as the ADS reference judges them, with the forms real completions take.

    check(r"... so she pays \\boxed{\\$18}.", "18")          # True
    check("... 6*7 = 42.\\nAnswer: 42", "42")                 # True (the DAPO-Math-17k format)
    check(r"\\boxed{17} ... no: \\boxed{18}", "18")            # True: the last answer counts

What it does: a thin pre-normalisation, then math-verify does the maths.
1. The final-answer span of the completion: the content of the last balanced ``\\boxed{}``/``\\fbox{}`` or
   the last ``Answer:`` line (also ``**Answer:**``, ``Final Answer:``), whichever comes later. A completion
   with neither has no answer (False), even when the right number appears somewhere in its working. An
   answer line loses its markdown emphasis (``**18**``) and the phrases of the Minerva format ("The final
   answer is $X$. I hope it is correct.").
2. When the reference is a plain number (GSM8K, DAPO-Math), units go: ``$``, ``\\$``, ``%``, TeX spaces
   (``\\,``, ``~``) and thousands separators (``1\\,600``), ``\\text{ dollars}``, trailing words
   (``18 eggs``), and a unit's exponent with its unit (``\\text{ cm}^{2}``, ``5 m^2``). math-verify alone
   reads ``18 eggs`` as 18·e·g·g·s and ``1\\,600`` as 601; a unit stripped without its exponent would leave
   ``3\\text{ m}^2`` as 3² = 9.
   A span that names alternatives (``x=18 \\text{ or } x=20``) is right only when every one of them is: a
   hedge between two different values is wrong, the same value twice is not.
3. ``verify(parse(boxed reference), parse(boxed span))``: reference first, since `verify` is not symmetric.

Forms, as a person grades them (`answer` is the reference; each form is in tests/test_data_answers.py, right
and wrong):

    | form                | example (the end of a completion)                             | answer | graded |
    |---------------------|---------------------------------------------------------------|--------|--------|
    | boxed               | \\boxed{18}                                                   | 18     | right  |
    | currency, percent   | \\boxed{\\$18.00}, \\boxed{50\\%}                             | 18, 50 | right  |
    | unit words          | \\boxed{18 \\text{ dollars}}, \\boxed{18 eggs}                | 18     | right  |
    | TeX space, unit     | \\boxed{18~\\text{minutes}}                                   | 18     | right  |
    | unit with exponent  | \\boxed{54\\text{ cm}^{2}}                                    | 54     | right  |
    | unit with exponent  | \\boxed{3\\text{ m}^2}                                        | 9      | wrong  |
    | thousands separator | \\boxed{1\\,600}, \\boxed{1,600}                              | 1600   | right  |
    | fraction            | \\boxed{\\frac{1}{2}}                                         | 0.5    | right  |
    | answer line         | Answer: 42                                                    | 42     | right  |
    | markdown bold       | **Answer: 18**, Answer: **18**                                | 18     | right  |
    | Minerva format      | Final Answer: The final answer is $42$. I hope it is correct. | 42     | right  |
    | hedge, two values   | \\boxed{x=18 \\text{ or } x=20}                               | 20     | wrong  |
    | hedge, one value    | \\boxed{x=20 \\text{ or } x=20}                               | 20     | right  |
    | two boxes: the last | \\boxed{17} ... no: \\boxed{18}                               | 18     | right  |
    | no final answer     | ... 3 * 6 = 18 ... I give up.                                 | 18     | wrong  |

Pitfalls this module exists for:
- math-verify's timeouts use `signal.alarm`, which raises off the main thread (and `parse` re-raises it
  even with `raise_on_error=False`); off the main thread the timeout is therefore off. Forked worker
  processes (`datasets.map(num_proc=...)`, launched ranks) run the check on their own main thread, with it;
- the alarm replaces a SIGALRM handler of the host program while a call runs;
- `import math_verify` takes about half a second (sympy, antlr): it happens on the first check only.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

TIMEOUT_S = 5  # per parse / verify call, on the main thread
_NUM_GOLD = re.compile(r"^\s*[-+]?(\d{1,3}(,\d{3})+|\d+)?(\.\d+)?\s*$")
_ANSWER_LINE = re.compile(r"^\W*(?:final\s+)?answer\W*:\s*(.+?)\s*$", re.I | re.M)
_EXPONENT = r"\^\s*(?:\{[^{}]*\}|\w)"  # ^2, ^{2}, ^{-1}
_TEXT_WORDS = re.compile(
    r"\\(?:text|textrm|textnormal|mbox|mathrm|textbf|textit)\s*\{\s*([^{}]*)\}(\s*" + _EXPONENT + ")?"
)
# A bare unit with an exponent after a number and a space: `5 m^2`, `54 cm^{2}` (not `2x^2`, an expression).
_BARE_UNIT_POWER = re.compile(r"(?<=[\d}])\s+[A-Za-z]+\s*" + _EXPONENT + r"\s*\.?\s*$")
# Alternatives in one answer: `x=18 \text{ or } x=20`, `18 or 20` (not `\lor`, `color`, `for`).
_OR = re.compile(
    r"\s*(?:\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{\s*or\s*\}|(?<![\\A-Za-z])or(?![A-Za-z]))\s*"
)
# Markdown emphasis around an answer line's value: `**Answer: 18**` leaves `18**`, `Answer: **18**` `**18**`.
_EMPHASIS = re.compile(r"^[*_\s]+|[*_\s]+(?=\.?$)")
# The Minerva format's phrases: `Final Answer: The final answer is $42$. I hope it is correct.`
_MINERVA = re.compile(
    r"^(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*(.+?)\s*(?:\.?\s*I hope it is correct\.?)?$", re.I | re.S
)
_TRAILING_WORDS = re.compile(r"^(.*?[\d}%.])(?:\s*[A-Za-z][A-Za-z'/.-]*)+\s*\.?\s*$", re.S)


@functools.cache
def _math_verify():
    """(parse, verify, extraction config), imported on first use."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ImportError(
            "checking math answers needs math-verify (a core dependency of opdkit); install it with "
            "pip install 'math-verify>=0.9'."
        ) from exc
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # the one-time "timeout disabled" warning
    return parse, verify, (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())


def last_boxed(text: str) -> tuple[int, str] | None:
    """(start, content) of the last ``\\boxed{...}`` or ``\\fbox{...}`` with balanced braces; None if none."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = (m.start(), text[m.end() : i - 1])
    return best


def extract_boxed(text: str) -> str | None:
    r"""Content of the last balanced ``\boxed{...}`` (or ``\fbox{...}``), stripped; None if there is none.
    Reference answers of worked solutions are read with it (`prompts.final_answer`)."""
    found = last_boxed(text)
    return found[1].strip() if found else None


def final_span(completion: str) -> tuple[int, str] | None:
    """(start, text) of the final answer: the last boxed answer or the last `Answer:` line, whichever is
    later."""
    boxed = last_boxed(completion)
    lines = list(_ANSWER_LINE.finditer(completion))
    line = (lines[-1].start(), _answer_line_value(lines[-1].group(1))) if lines else None
    candidates = [c for c in (boxed, line) if c is not None]
    return max(candidates, key=lambda c: c[0]) if candidates else None


def _answer_line_value(text: str) -> str:
    """An answer line's value without the Minerva format's phrases and markdown emphasis."""
    m = _MINERVA.match(text)
    if m:
        text = m.group(1)
    return _EMPHASIS.sub("", text).strip()


def alternatives(span: str) -> list[str]:
    """The values a span names joined by "or" (`x=18 \\text{ or } x=20` -> two); the span alone when it names
    one, or when a split would cut a brace group (an "or" inside `\\text{...}`)."""
    parts = _OR.split(span)
    if len(parts) < 2 or any(p.count("{") != p.count("}") or not p.strip() for p in parts):
        return [span]
    return parts


def strip_units(span: str) -> str:
    """A numeric answer without currency, percent, TeX spacing, thousands separators and unit words (with
    their exponents)."""
    s = span.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=\d)(?:\\[,!;: ]|\{,\})\s*(?=\d{3})", "", s)  # 1\,600 and 1{,}600 -> 1600
    s = re.sub(r"\\[!;: ,]|~", " ", s).strip()  # other TeX spaces; ~ is TeX's unbreakable space
    # \text{18} -> 18; \text{ dollars} -> "" and \text{ cm}^{2} -> "" (words only: the exponent is the unit's)
    s = _TEXT_WORDS.sub(lambda m: m.group(1) + (m.group(2) or "") if re.search(r"\d", m.group(1)) else " ", s)
    s = s.strip()
    s = _BARE_UNIT_POWER.sub("", s)
    m = _TRAILING_WORDS.match(s)
    if m and re.search(r"\d", m.group(1)):
        s = m.group(1).rstrip(".").strip()
    return s.rstrip(".").strip()


def reference(answer: str) -> tuple[str, bool]:
    """(the reference's final answer, whether it is a plain number); a GSM8K solution's is after ``####``."""
    answer = str(answer)
    if "####" in answer:
        answer = answer.split("####")[-1]
    answer = answer.strip()
    numeric = bool(_NUM_GOLD.match(answer)) and any(c.isdigit() for c in answer)
    return (answer.replace(",", "") if numeric else answer), numeric


def _timeout() -> int | None:
    """math-verify's signal-based timeout works on the main thread only; elsewhere it is off."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def check(completion: str, answer: str) -> bool:
    """True when the completion's final answer equals the reference `answer` (math-verify equivalence)."""
    parse, verify, config = _math_verify()
    gold_text, numeric = reference(answer)
    span = final_span(completion)
    if not gold_text or span is None:
        return False
    # A plain number answers with one value: each alternative of a hedge must be it. Other references (a
    # set of solutions, `x=2 \\text{ or } x=3`) go to math-verify whole, which reads "or" as a set.
    preds = [strip_units(p) for p in alternatives(span[1])] if numeric else [span[1]]
    if not all(preds):
        return False
    to = _timeout()
    gold = parse("\\boxed{" + gold_text + "}", extraction_config=config, parsing_timeout=to)
    if not gold:
        return False
    for pred_text in preds:
        pred = parse("\\boxed{" + pred_text + "}", extraction_config=config, parsing_timeout=to)
        if not (pred and verify(gold, pred, timeout_seconds=to)):
            return False
    return True
