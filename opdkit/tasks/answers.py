"""Math answers judged by math-verify, as the ADS reference judges them, with the forms real completions take.

    check(r"... so she pays \\boxed{\\$18}.", "18")          # True
    check("... 6*7 = 42.\\nAnswer: 42", "42")                 # True (the DAPO-Math-17k format)
    check(r"\\boxed{17} ... no: \\boxed{18}", "18")            # True: the last answer counts

What it does: find the final answer as a careful grader would, read its numbers as a person reads them,
then math-verify does the maths.
1. The final answer (`final_span`). Answers come in two kinds:
   - stated as a final answer: a balanced ``\\boxed{}``/``\\fbox{}``; an ``Answer:`` line (also
     ``**Answer:**``, ``Final Answer:``) whose value stands alone (``Answer: 42``, ``Answer: $18 (dollars)``,
     the Minerva format "The final answer is $X$. I hope it is correct."; a value followed by sentences
     counts up to its first full stop: ``Answer: 18. She pays 18 dollars.`` is 18); GSM8K's ``#### 18`` line,
     a number alone (a markdown heading ``#### Step 2`` is not an answer);
   - said in a sentence: an ``Answer:`` line that is one (``Answer: The total cost is $18.``) or "the answer
     is 18" in prose, where a value follows the words at once. A sentence's value is what follows its last
     "is/are/was/were/be/equals/=" (a value, not a word), else its last number.
   The final answer is the last stated one; a sentence counts only where nothing is stated. The last
   counts because a model corrects itself by answering again (``\\boxed{41}? No: ... Answer: 42``). A
   sentence never overrides a stated answer: after a box it restates or comments on it ("Answer: The total
   is 20 before the discount" after ``\\boxed{18}``), and the box is the form the prompt asked for; were the
   sentence to win, a completion would be graded by its chatter. A completion with neither has no answer
   (False), even when the right number appears somewhere in its working. An answer line loses its markdown
   emphasis (``**18**``).
2. Numbers as a person reads them, in the reference and the answer: a mixed number is its sum (``1 1/2``
   and ``1\\frac{1}{2}`` are 3/2, never 1 or 11/2: math-verify alone reads ``1 1/2`` as 1), thousands are
   separated by a comma or a space only in groups of exactly three digits (``1 000`` is 1000; ``1 2`` is two
   numbers, no answer to a number, where math-verify reads 3).
3. When the reference is a number (GSM8K, DAPO-Math: an integer, decimal or fraction, also with a unit
   such as ``4 cups`` or ``$18``), units go from both: ``$``, ``\\$``, ``%``, TeX spaces (``\\,``, ``~``)
   and thousands separators (``1\\,600``), ``\\text{ dollars}``, trailing words (``18 eggs``) and words in
   parentheses (``18 (dollars)``), and a unit's exponent with its unit (``\\text{ cm}^{2}``, ``5 m^2``).
   math-verify alone reads ``18 eggs`` as 18·e·g·g·s and ``1\\,600`` as 601; a unit stripped without its
   exponent would leave ``3\\text{ m}^2`` as 3² = 9. Units are not compared: the number is the answer
   (``4 cups`` against ``\\boxed{4 liters}`` is right; converting units is beyond this check).
   A span that names alternatives (``x=18 \\text{ or } x=20``) is right only when every one of them is: a
   hedge between two different values is wrong, the same value twice is not.
4. ``verify(parse(boxed reference), parse(boxed span))``: reference first, since `verify` is not symmetric.

Forms, as a person grades them (`answer` is the reference; each form is in tests/test_tasks_answers.py, right
and wrong):

    | form                 | example (the end of a completion)                             | answer | graded |
    |----------------------|---------------------------------------------------------------|--------|--------|
    | boxed                | \\boxed{18}                                                   | 18     | right  |
    | currency, percent    | \\boxed{\\$18.00}, \\boxed{50\\%}                             | 18, 50 | right  |
    | unit words           | \\boxed{18 \\text{ dollars}}, \\boxed{18 eggs}                | 18     | right  |
    | TeX space, unit      | \\boxed{18~\\text{minutes}}                                   | 18     | right  |
    | unit with exponent   | \\boxed{54\\text{ cm}^{2}}                                    | 54     | right  |
    | unit with exponent   | \\boxed{3\\text{ m}^2}                                        | 9      | wrong  |
    | thousands separator  | \\boxed{1\\,600}, \\boxed{1,600}, \\boxed{1 000}              | 1600   | right  |
    | two numbers          | \\boxed{1 2}                                                  | 12     | wrong  |
    | fraction             | \\boxed{\\frac{1}{2}}                                         | 0.5    | right  |
    | mixed number         | \\boxed{1 1/2}                                                | 1.5    | right  |
    | mixed number         | \\boxed{1 1/2}                                                | 1      | wrong  |
    | reference with unit  | \\boxed{4}                                                    | 4 cups | right  |
    | answer line          | Answer: 42                                                    | 42     | right  |
    | unit in parentheses  | Answer: 18 (dollars)                                          | 18     | right  |
    | markdown bold        | **Answer: 18**, Answer: **18**                                | 18     | right  |
    | Minerva format       | Final Answer: The final answer is $42$. I hope it is correct. | 42     | right  |
    | GSM8K format         | #### 18                                                       | 18     | right  |
    | answer sentence      | Answer: The total cost is $18.                                | 18     | right  |
    | answer in prose      | ..., so the answer is 18.                                     | 18     | right  |
    | sentence after a box | \\boxed{18} Answer: The total is 20 before the discount.      | 20     | wrong  |
    | hedge, two values    | \\boxed{x=18 \\text{ or } x=20}                               | 20     | wrong  |
    | hedge, one value     | \\boxed{x=20 \\text{ or } x=20}                               | 20     | right  |
    | two boxes: the last  | \\boxed{17} ... no: \\boxed{18}                               | 18     | right  |
    | no final answer      | ... 3 * 6 = 18 ... I give up.                                 | 18     | wrong  |

Pitfalls this module exists for:
- every completion of an evaluation goes through `final_span`, so it reads a completion in linear time:
  one pass for the boxes (a scan per ``\\boxed{`` took 24-39 s on 20k characters of unclosed boxes), and no
  pattern that backtracks over runs of blank lines, spaces, dots or letters (20 s to over 100 s there); a
  final answer longer than `MAX_ANSWER_CHARS` is wrong unread (math-verify ran to its 5 s timeout on a
  20k-character degenerate box, and off the main thread it has no timeout);
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
import string
import threading

TIMEOUT_S = 5  # per parse / verify call, on the main thread
SENTENCE_CHARS = 300  # how far a value said in a sentence may run
MAX_ANSWER_CHARS = 500  # a longer final answer is a degenerate one (math-verify could take seconds on it)
UNIT_WORDS_CHARS = 100  # unit words longer than this are a sentence, not a unit

# A reference that is a number: an integer, a decimal or a fraction of integers (after `_numbers`).
_PLAIN_NUMBER = re.compile(r"[-+]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?|\\[dt]?frac\{\d+\}\{\d+\})")
# A number glued to letters (`5x`, `\frac{1}{2}x`) is an expression, not a number with a unit.
_GLUED_LETTERS = re.compile(r"[\d}][A-Za-z]")
_BOX_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# `[^\w\n]*`, not `\W*`: \W matches newlines, and `^\W*` then backtracks over every run of blank lines.
_ANSWER_LINE = re.compile(r"^[^\w\n]*(?:final[ \t]+)?answer[^\w\n]*:\s*([^\n]*)", re.I | re.M)
_GSM8K_LINE = re.compile(r"^[ \t]*####[ \t]*([^\n]*)", re.M)
_GSM8K_VALUE = re.compile(r"[-+]?(?:\\?\$)?[\d,. ]*\d(?:/\d+)?(?:\\?%)?\.?")
# The start of a value: a digit, a sign or currency before one, math (`$\frac..`, `\(`, `\frac`).
_VALUE_AHEAD = r"(?=(?:\*\*|__)?[-+]?(?:\d|\.\d|\\?\$|\\[A-Za-z(\[]))"
_ANSWER_IS = re.compile(
    r"\b(?:the\s+)?(?:final\s+)?answer\s+(?:is|would\s+be|should\s+be|will\s+be)\b\s*:?\s*" + _VALUE_AHEAD,
    re.I,
)
_COPULA = re.compile(r"(?:\b(?:is|are|was|were|be|equals?|equal\s+to)\b|=)\s*:?\s*" + _VALUE_AHEAD, re.I)
# A sentence's numbers (its last is its value when no "is" names one): `\frac{3}{4}`, 1,600, 1 000, 1 1/2.
_NUMBER = re.compile(
    r"\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}|-?(?:\d{1,3}(?:[, ]\d{3}(?![\d/]))+|\d+)(?:\.\d+)?"
    r"(?:\s+\d+/\d+(?!\.?\d)|/\d+)?"
)
_CLAUSE_END = re.compile(r"[.;!?](?=\s|$)|,\s+(?=[A-Za-z])|\n")
_FIRST_SENTENCE_END = re.compile(r"(?<=\S)[.!?]\s+(?=[A-Z])")
# An answer line that is a sentence begins with a word and goes on (`The total`, `Total: 18`, `I think`);
# `x = 5`, `sin x`, `pi/2` and `Tuesday.` are values.
_SENTENCE_START = re.compile(r"([A-Za-z]{2,}|[AI])[\s,:]+[\w$\\]")
_MATH_WORDS = {"sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "sqrt", "pi", "infty"}
_MINERVA_START = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*", re.I)
_MINERVA_END = "i hope it is correct"
_EMPHASIS = "*_" + string.whitespace

_EXPONENT = r"\^\s*(?:\{[^{}]*\}|\w)"  # ^2, ^{2}, ^{-1}
_TEXT_WORDS = re.compile(
    r"\\(?:text|textrm|textnormal|mbox|mathrm|textbf|textit)\s*\{\s*([^{}]*)\}(\s*" + _EXPONENT + ")?"
)
# A bare unit with an exponent after a number and a space: `5 m^2`, `54 cm^{2}` (not `2x^2`, an expression).
_BARE_UNIT_POWER = re.compile(r"(?<=[\d}])\s+[A-Za-z]+\s*" + _EXPONENT + r"\s*\.?\s*$")
_PAREN_WORDS = re.compile(r"(?<=[\d}\s])\(\s*[A-Za-z][A-Za-z\s'.-]*\)\s*\.?\s*$")  # 18 (dollars)
# Unit words at the end, after a number: each word starts with a letter. One way to split a run of letters
# into words (`(?:\s*[A-Za-z][A-Za-z.-]*)+` has exponentially many, and backtracks through them all).
_UNIT_WORDS = re.compile(r"(?<=[\d}%.])\s*[A-Za-z](?:[A-Za-z'/.-]|\s+[A-Za-z])*\s*\.?\s*$")
# A letter glued to a number that names a variable, not a unit: `2x`, `3n`, `2i` (`5cm`, `18eggs` are units).
_VARIABLE = re.compile(r"[abijknxyz](?![A-Za-z])")
_UNIT_CHARS = set(string.ascii_letters + "'/.-" + string.whitespace)
# Alternatives in one answer: `x=18 \text{ or } x=20`, `18 or 20` (not `\lor`, `color`, `for`).
_OR = re.compile(r"\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{\s*or\s*\}|(?<![\\A-Za-z])or(?![A-Za-z])")
# Numbers a person reads as one: 1,600 and 1 000 (groups of three digits), 1 1/2 and 1\frac{1}{2}.
_THOUSANDS = re.compile(r"(?<![\d.,/])\d{1,3}(?:[, ]\d{3})+(?![\d/]|,\d)")
_MIXED = re.compile(r"(?<![\w.,/^])(\d+)(?:\s+(\d+)/(\d+)|\s*\\[dt]?frac\s*\{(\d+)\}\s*\{(\d+)\})(?!\.?\d)")
_TWO_NUMBERS = re.compile(r"\d\s+\d")


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
    """(start, content) of the last ``\\boxed{...}`` or ``\\fbox{...}`` with balanced braces; None if none.
    One pass over the braces: a box closes where the depth returns to its own."""
    best = None
    open_boxes: list[tuple[int, int, int]] = []  # (start, content start, depth inside it)
    depth = 0
    for m in _BOX_OR_BRACE.finditer(text):
        if m.group() == "}":
            if open_boxes and open_boxes[-1][2] == depth:
                start, begin, _ = open_boxes.pop()
                if best is None or start > best[0]:
                    best = (start, text[begin : m.start()])
            depth -= 1
        else:
            depth += 1
            if m.group() != "{":
                open_boxes.append((m.start(), m.end(), depth))
    return best


def extract_boxed(text: str) -> str | None:
    r"""Content of the last balanced ``\boxed{...}`` (or ``\fbox{...}``), stripped; None if there is none.
    Reference answers of worked solutions are read with it (`opdkit.tasks.math.final_answer`)."""
    found = last_boxed(text)
    return found[1].strip() if found else None


def final_span(completion: str) -> tuple[int, str] | None:
    """(start, text) of the final answer: the last one stated (a box, an `Answer:` line with a value, a
    GSM8K `#### 18` line); where none is, the last one said in a sentence (`Answer: The total is $18.`,
    "the answer is 18"). None without either."""
    stated: list[tuple[int, str]] = []
    said: list[tuple[int, str]] = []
    boxed = last_boxed(completion)
    if boxed:
        stated.append(boxed)
    for m in _ANSWER_LINE.finditer(completion):
        value = _answer_line_value(m.group(1))
        if value and _is_sentence(value):
            said.append((m.start(), sentence_value(value) or value))
        elif value:
            stated.append((m.start(), _FIRST_SENTENCE_END.split(value, maxsplit=1)[0]))
    for m in _GSM8K_LINE.finditer(completion):
        if _GSM8K_VALUE.fullmatch(m.group(1).strip()):
            stated.append((m.start(), m.group(1).strip()))
    said += [(m.start(), _clause(completion, m.end())) for m in _ANSWER_IS.finditer(completion)]
    found = stated or said
    return max(found, key=lambda c: c[0]) if found else None


def _answer_line_value(text: str) -> str:
    """An answer line's value without the Minerva format's phrases and markdown emphasis."""
    text = text.strip()
    m = _MINERVA_START.match(text)
    if m:
        text = text[m.end() :]
        if text.lower().rstrip(" .").endswith(_MINERVA_END):
            text = text.rstrip(" .")[: -len(_MINERVA_END)].rstrip()
            text = text[:-1] if text.endswith(".") else text
    text = text.lstrip(_EMPHASIS).rstrip()
    dot = text.endswith(".")
    text = text[:-1].rstrip(_EMPHASIS) + "." if dot else text.rstrip(_EMPHASIS)
    return text.strip()


def _is_sentence(value: str) -> bool:
    m = _SENTENCE_START.match(value)
    return bool(m) and m.group(1).lower() not in _MATH_WORDS


def sentence_value(sentence: str) -> str | None:
    """The value a sentence states: what follows its last "is"/"are"/"equals"/"=" up to the clause's end
    (`The total cost is $18.` -> `$18`), else its last number; None without one."""
    copulas = list(_COPULA.finditer(sentence))
    if copulas:
        return _clause(sentence, copulas[-1].end())
    numbers = _NUMBER.findall(sentence)
    return numbers[-1] if numbers else None


def _clause(text: str, start: int) -> str:
    """The text from `start` to the end of its clause (a full stop, a comma before words, a line's end)."""
    end = _CLAUSE_END.search(text, start, start + SENTENCE_CHARS)
    return _answer_line_value(text[start : end.start() if end else start + SENTENCE_CHARS])


def alternatives(span: str) -> list[str]:
    """The values a span names joined by "or" (`x=18 \\text{ or } x=20` -> two); the span alone when it names
    one, or when a split would cut a brace group (an "or" inside `\\text{...}`)."""
    parts = [p.strip() for p in _OR.split(span)]
    if len(parts) < 2 or any(p.count("{") != p.count("}") or not p for p in parts):
        return [span]
    return parts


def strip_units(span: str) -> str:
    """A numeric answer without currency, percent, TeX spacing, thousands separators and unit words (with
    their exponents, or in parentheses)."""
    s = span.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=\d)(?:\\[,!;: ]|\{,\})\s*(?=\d{3})", "", s)  # 1\,600 and 1{,}600 -> 1600
    s = re.sub(r"\\[!;: ,]|~", " ", s).strip()  # other TeX spaces; ~ is TeX's unbreakable space
    # \text{18} -> 18; \text{ dollars} -> "" and \text{ cm}^{2} -> "" (words only: the exponent is the unit's)
    s = _TEXT_WORDS.sub(lambda m: m.group(1) + (m.group(2) or "") if re.search(r"\d", m.group(1)) else " ", s)
    s = s.strip()
    s = _BARE_UNIT_POWER.sub("", s)
    s = _PAREN_WORDS.sub("", s).strip()
    s = _cut_unit_words(s)
    return s.rstrip(".").strip()


def _cut_unit_words(s: str) -> str:
    """`18 eggs` -> `18`: the words after the number, when they are a unit's few (linear time); `2x` stays."""
    start = len(s)
    while start and s[start - 1] in _UNIT_CHARS:
        start -= 1
    if len(s) - start > UNIT_WORDS_CHARS:
        return s
    m = _UNIT_WORDS.search(s, start)
    if m and re.search(r"\d", s[: m.start()]) and not _VARIABLE.match(m.group()):
        return s[: m.start()].rstrip(".").strip()
    return s


def _numbers(text: str, commas: bool) -> str:
    """Numbers as a person reads them: thousands joined (`1 000`, and `1,600` where `commas`), a mixed number
    summed (`1 1/2`, `1\\frac{1}{2}` -> `\\frac{3}{2}`)."""

    def join(m: re.Match) -> str:
        return m.group() if "," in m.group() and not commas else re.sub("[, ]", "", m.group())

    return _MIXED.sub(_mixed_fraction, _THOUSANDS.sub(join, text))


def _mixed_fraction(m: re.Match) -> str:
    whole, num, den = int(m.group(1)), int(m.group(2) or m.group(4)), int(m.group(3) or m.group(5))
    return m.group() if den == 0 else f"\\frac{{{whole * den + num}}}{{{den}}}"


def number_text(span: str) -> str:
    """A span answering a number, as one: units gone, numbers read as a person reads them; empty when the
    span names two numbers side by side (`1 2`)."""
    s = _numbers(strip_units(span), commas=True)
    return "" if _TWO_NUMBERS.search(s) else s


def reference(answer: str) -> tuple[str, bool]:
    """(the reference's final answer, whether it is a number); a GSM8K solution's is after ``####``. A
    number's unit goes (`4 cups` -> `4`); a number glued to letters (`5x`) is an expression."""
    answer = str(answer)
    if "####" in answer:
        answer = answer.split("####")[-1]
    answer = answer.strip()
    if not _GLUED_LETTERS.search(answer):
        number = number_text(answer)
        if _PLAIN_NUMBER.fullmatch(number):
            return number, True
    return _numbers(answer, commas=False), False


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
    # A number answers with one value: each alternative of a hedge must be it. Other references (a set of
    # solutions, `x=2 \\text{ or } x=3`) go to math-verify whole, which reads "or" as a set.
    preds = [number_text(p) for p in alternatives(span[1])] if numeric else [_numbers(span[1], commas=False)]
    if not all(0 < len(p) <= MAX_ANSWER_CHARS for p in preds):
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
