"""Math answers judged by math-verify, as the ADS reference judges them, with the forms real completions take.

    check(r"... so she pays \\boxed{\\$18}.", "18")          # True
    check("... 6*7 = 42.\\nAnswer: 42", "42")                 # True (the DAPO-Math-17k format)
    check(r"\\boxed{17} ... no: \\boxed{18}", "18")            # True: the last answer counts

What it does: a thin pre-normalisation, then math-verify does the maths.
1. The final-answer span of the completion: the content of the last balanced ``\\boxed{}``/``\\fbox{}`` or
   the last ``Answer:`` line (also ``**Answer:**``, ``Final Answer:``), whichever comes later. A completion
   with neither has no answer (False), even when the right number appears somewhere in its working.
2. When the reference is a plain number (GSM8K, DAPO-Math), units go: ``$``, ``\\$``, ``%``, TeX spaces
   and thousands separators (``1\\,600``), ``\\text{ dollars}``, trailing words (``18 eggs``). math-verify
   alone reads ``18 eggs`` as 18·e·g·g·s and ``1\\,600`` as 601.
3. ``verify(parse(boxed reference), parse(boxed span))``: reference first, since `verify` is not symmetric.

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
_TEXT_WORDS = re.compile(r"\\(?:text|textrm|textnormal|mbox|mathrm|textbf|textit)\s*\{\s*([^{}]*)\}")
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
    line = (lines[-1].start(), lines[-1].group(1)) if lines else None
    candidates = [c for c in (boxed, line) if c is not None]
    return max(candidates, key=lambda c: c[0]) if candidates else None


def strip_units(span: str) -> str:
    """A numeric answer without currency, percent, TeX spacing, thousands separators and unit words."""
    s = span.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"(?<=\d)(?:\\[,!;: ]|\{,\})\s*(?=\d{3})", "", s)  # 1\,600 and 1{,}600 -> 1600
    s = re.sub(r"\\[!;: ,]", " ", s).strip()  # other TeX spaces
    # \text{18} -> 18; \text{ dollars} -> "" (words only)
    s = _TEXT_WORDS.sub(lambda m: m.group(1) if re.search(r"\d", m.group(1)) else " ", s).strip()
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
    pred_text = strip_units(span[1]) if numeric else span[1]
    if not pred_text:
        return False
    to = _timeout()
    gold = parse("\\boxed{" + gold_text + "}", extraction_config=config, parsing_timeout=to)
    pred = parse("\\boxed{" + pred_text + "}", extraction_config=config, parsing_timeout=to)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=to))
