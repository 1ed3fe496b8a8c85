"""The math task's check (math-verify): the answer forms real GSM8K / DAPO-Math completions take are right,
wrong answers stay wrong, in the main thread, in worker threads and in forked processes."""

import multiprocessing
import random
import re
import threading
import time

import pytest

from opdkit import tasks
from opdkit.tasks import answers

WORK = "Let me think. 3 * 6 = 18, then 18 + 5 = 23, and 23 - 5 = 18.\n"
AREA = "The rectangle is 6 cm by 9 cm, so its area is 6 \\times 9 = 54 square centimetres.\n\n"
SQUARE = "The square's perimeter is 12 m, so its side is 12 / 4 = 3 m.\n\n"
MINERVA = "Solution: 6 \\cdot 7 = 42.\nFinal Answer: The final answer is $42$. I hope it is correct."
HEDGE = "Solving x^2 - 38x + 360 = 0 gives (x - 18)(x - 20) = 0.\n\n"
RIGHT = [  # (completion, reference answer): forms named in issue 13 and their relatives
    (WORK + r"The answer is \boxed{18 \text{ dollars}}.", "18"),
    (WORK + r"The answer is \boxed{\$18}.", "18"),
    (WORK + r"The answer is \boxed{18 eggs}.", "18"),
    (WORK + r"So \boxed{50\%}", "50"),
    (WORK + r"Total: \boxed{1,600}", "1600"),
    (WORK + r"Thus \boxed{\frac{1}{2}}", "0.5"),
    ("Step 1: 6*7 = 42. Step 2: check 40+2 = 42.\n\nAnswer: 42", "42"),  # DAPO-Math's answer line
    (r"\boxed{\$18.00}", "18"),
    (r"\boxed{18\ \text{dollars}}", "18"),
    (r"\boxed{5 square feet}", "5"),
    (r"\boxed{\dfrac{1}{2}}", "0.5"),
    (r"\boxed{1\,600}", "1600"),  # math-verify alone reads this as 601
    (r"\boxed{1{,}600}", "1600"),
    ("**Answer:** 1,600", "1600"),
    (r"First \boxed{17}. Wait, that is wrong: \boxed{18}", "18"),  # the last answer counts
    ("Maybe \\boxed{41}? No: 6*7 = 42.\nAnswer: 42", "42"),
    ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{18}", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 18"),  # a GSM8K solution as reference
    # issue 21: forms a person grades right
    (AREA + r"The area is \boxed{54\text{ cm}^{2}}.", "54"),  # the unit goes with its exponent
    (SQUARE + r"Its area is 3^2, so the area is \boxed{9\text{ m}^2}.", "9"),
    (AREA + r"The area is \boxed{54 \, \mathrm{cm}^2}.", "54"),
    (AREA + r"The area is \boxed{54 cm^2}.", "54"),
    (r"So \boxed{2^{10}}", "1024"),  # an exponent on a number is maths, not a unit's
    (WORK + "**Answer: 18**", "18"),
    (WORK + "Answer: **18**", "18"),
    (WORK + "**Answer:** **18**.", "18"),
    (MINERVA, "42"),
    (MINERVA.replace("$42$", r"$\frac{3}{4}$"), r"\frac{3}{4}"),
    (WORK + r"She needs \boxed{18~\text{minutes}}.", "18"),
    (HEDGE + r"Both roots work: \boxed{x=20 \text{ or } x=20}", "20"),  # the same value twice
    (HEDGE + r"\boxed{x=18 \text{ or } x=20}", "x=18, x=20"),  # a reference with two values
    # issue 28: forms a person grades right
    (WORK + "#### 18", "18"),  # GSM8K's own answer line
    (WORK + "#### 1,600", "1600"),
    ("#### Step 1: the eggs\n3 * 6 = 18\n\n#### Step 2\n\\boxed{18}", "18"),  # headings are not answers
    (WORK + "So, the answer is 18.", "18"),  # in prose, no box
    (WORK + "Therefore the answer is $18$, the money she makes.", "18"),
    (WORK + "The answer is: **18 dollars**.", "18"),
    (WORK + "Answer: The total cost is $18.", "18"),  # the number in a sentence
    (WORK + "Answer: She has 18 eggs left.", "18"),  # no "is": its last number
    ("Answer: Natalia sold 48 clips in April and 24 in May, 72 in all.", "72"),
    ("Answer: The probability is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    (WORK + "Answer: 18 (dollars)", "18"),
    (WORK + "Answer: 18. She pays 18 dollars in all.", "18"),  # the value, up to its full stop
    (r"\boxed{1 1/2}", "1.5"),  # a mixed number is its sum
    (r"\boxed{1 1/2}", r"\frac{3}{2}"),
    (r"\boxed{1\frac{1}{2}}", "1.5"),
    (r"\boxed{-2 3/4}", "-2.75"),
    ("Answer: 1 1/2 cups.", "1.5"),
    ("Answer: She needs 1 1/2 cups of flour.", "1.5"),
    (r"\boxed{1.5}", "1 1/2"),  # in the reference too
    (r"\boxed{1 000}", "1000"),  # thousands separated by a space
    (r"\boxed{12 345 678}", "12345678"),
    (r"\boxed{1000}", "1 000"),
    (r"\boxed{4}", "4 cups"),  # a reference with a unit
    (r"\boxed{4 cups}", "4 cups"),
    (r"\boxed{\$18}", "$18"),
    (r"\boxed{18}" + "\nAnswer: The total is 20 before the discount.", "18"),  # a sentence after a box: was
    # wrong, the line won (and read as a whole, it equalled nothing)
    (r"\boxed{18}" + "\nAnswer: The total cost is $18.", "18"),  # restating it
    (r"\boxed{18}. So the answer is 20 without the tip.", "18"),
    ("So the answer is 17. No: the answer is 18.", "18"),  # the last sentence, where nothing is stated
    (r"\boxed{5cm}", "5"),  # a unit glued to its number
]
WRONG = [
    (WORK + r"\boxed{17}", "18"),
    (WORK + r"\boxed{1,601}", "1600"),
    (WORK + r"\boxed{\frac{1}{3}}", "0.5"),
    ("I am not sure how to solve this problem.", "18"),
    (WORK + "I give up.", "18"),  # 18 appears in the working, but there is no final answer
    (WORK + r"\boxed{18}", "180"),
    (r"First \boxed{18}. Wait, that is wrong: \boxed{17}", "18"),
    (r"\boxed{-18}", "18"),
    (r"\boxed{3}", r"\sqrt{8}"),
    (r"\boxed{18}", ""),  # no reference answer: nothing can be right
    (r"\boxed{}", "18"),
    # issue 21: the same forms, graded wrong
    (SQUARE + r"The area is \boxed{3\text{ m}^2}.", "9"),  # the side as the area: was right (3^2 = 9)
    (AREA + r"The area is \boxed{54\text{ cm}^{2}}.", "45"),
    (AREA + r"The area is \boxed{45 cm^2}.", "54"),
    (r"So \boxed{2x^2}", "2"),  # an expression, not 2 with a unit
    (WORK + "**Answer: 17**", "18"),
    (WORK + "Answer: **81**", "18"),
    (MINERVA, "24"),
    (MINERVA.replace("$42$", "$41$"), "42"),
    (WORK + r"She needs \boxed{17~\text{minutes}}.", "18"),
    (HEDGE + r"So \boxed{x=18 \text{ or } x=20}", "20"),  # a hedge between two values: was right
    (HEDGE + r"So \boxed{x=18 \text{ or } x=20}", "18"),
    (HEDGE + "Answer: 18 or 20", "20"),
    (HEDGE + r"\boxed{x=18 \text{ or } x=21}", "x=18, x=20"),
    # issue 28: the same forms, graded wrong
    (WORK + "#### 17", "18"),
    (WORK + "#### 1,601", "1600"),
    ("#### Step 18\n3 * 6 = 18", "18"),  # a heading, and no final answer
    (WORK + "So, the answer is 17.", "18"),
    (WORK + "Therefore the answer is $17$, the money she makes.", "18"),
    (WORK + "The answer is not 18.", "18"),  # not a value after "is": no answer
    (WORK + "Answer: The total cost is $17.", "18"),
    (WORK + "Answer: She has 17 eggs left.", "18"),
    ("Answer: Natalia sold 48 clips in April and 24 in May, 72 in all.", "48"),
    ("Answer: The probability is $\\frac{3}{5}$.", "\\frac{3}{4}"),
    (WORK + "Answer: 17 (dollars)", "18"),
    (WORK + "Answer: 17. She pays 18 dollars in all.", "18"),
    (r"\boxed{1 1/2}", "1"),  # never its whole part
    (r"\boxed{1 1/2}", "11/2"),  # nor the digits run together
    (r"\boxed{1\frac{1}{2}}", "1"),
    (r"\boxed{-2 3/4}", "-2"),
    ("Answer: 1 1/2 cups.", "1"),
    ("Answer: She needs 1 1/2 cups of flour.", "0.5"),
    (r"\boxed{1}", "1 1/2"),
    (r"\boxed{1 000}", "1"),
    (r"\boxed{1 000}", "0"),  # math-verify alone reads 1 000 as 1*0
    (r"\boxed{1 2}", "12"),  # not a group of three digits: two numbers
    (r"\boxed{1 2}", "3"),  # math-verify alone reads 1 2 as 3
    (r"\boxed{1 00}", "100"),
    (r"\boxed{5}", "4 cups"),
    (r"\boxed{5 cups}", "4 cups"),
    (r"\boxed{\$17}", "$18"),
    (r"\boxed{18}" + "\nAnswer: The total is 20 before the discount.", "20"),
    (r"\boxed{17}" + "\nAnswer: The total cost is $18.", "18"),
    (r"\boxed{18}. So the answer is 20 without the tip.", "20"),
    ("So the answer is 18. No: the answer is 17.", "18"),
    (r"\boxed{2x}", "2"),  # a variable glued to its number, not a unit: was right
]
CASES = [(c, a, True) for c, a in RIGHT] + [(c, a, False) for c, a in WRONG]


@pytest.mark.parametrize("completion,answer,right", CASES)
def test_math_check(completion, answer, right):
    assert tasks.get_task("math").check(completion, answer) is right


def _all_as_expected() -> bool:
    return all(answers.check(c, a) is r for c, a, r in CASES)


def test_math_check_in_a_thread():
    """Off the main thread math-verify's signal.alarm timeout would raise; the check turns it off there."""
    out = []
    t = threading.Thread(target=lambda: out.append(_all_as_expected()))
    t.start()
    t.join()
    assert out == [True]


@pytest.mark.timeout(300)
def test_math_check_in_worker_processes():
    """In a worker process's main thread math-verify keeps its own timeout. Spawned, not forked: a fork of
    this (threaded) test process can inherit a lock another thread holds and hang."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        got = pool.starmap(answers.check, [(c, a) for c, a, _ in CASES])
    assert got == [r for _, _, r in CASES]


def test_math_answer_position():
    task = tasks.get_task("math")
    text = "so 6*7 = 42.\nAnswer: 42"
    assert task.extract_answer(text) == "42" and text[task.answer_start(text) :].startswith("Answer")
    assert task.answer_start(r"so \boxed{12}.") == 3 and task.extract_answer(r"so \boxed{12}.") == "12"
    assert task.answer_start("no answer here") is None and task.extract_answer("no answer here") is None
    assert task.extract_answer(MINERVA) == "$42$"  # the value, without the format's phrases
    assert task.extract_answer("**Answer: 18**") == task.extract_answer("Answer: **18**") == "18"
    # issue 28: a sentence's value; GSM8K's line and the prose answer begin where their words do
    assert task.extract_answer("Answer: The total cost is $18.") == "$18"
    assert task.extract_answer("Answer: 18 (dollars)") == "18 (dollars)"
    text = "so 6*7 = 42.\n#### 42"
    assert task.extract_answer(text) == "42" and text[task.answer_start(text) :] == "#### 42"
    text = "6*7 = 42, so the answer is 42."
    assert task.extract_answer(text) == "42" and text[task.answer_start(text) :].startswith("the answer")
    text = r"so \boxed{18}." + "\nAnswer: The total is 20."
    assert task.extract_answer(text) == "18" and task.answer_start(text) == 3  # the box, not the sentence


# Completions of 20k characters. Before issue 28 the degenerate ones took 5 s to over 100 s each: nested
# unclosed boxes (a scan per box), blank lines, spaces and letters (backtracking over a run at every start),
# a long final answer (math-verify's 5 s timeout).
LONG = {
    "working": ("3 * 6 = 18, then 18 + 5 = 23. " * 700)[:20_000] + r"\boxed{18}",
    "unclosed boxes": r"\boxed{" * 2_800 + r"18",
    "blank lines": "\n" * 20_000 + "I give up.",
    "spaces in an answer line": "Answer: 18" + " " * 20_000 + "x",
    "letters after a number": r"\boxed{18 " + "a" * 20_000 + "!}",
    "dots after a number": r"\boxed{18" + ". a" * 6_000 + "!}",
    "spaces in a box": r"\boxed{18" + " " * 20_000 + "x}",
    "mixed numbers in a box": r"\boxed{" + "1 1/2 " * 3_000 + "}",
    "a long sentence": "Answer: The " + "total is a " * 2_000 + "18",
    "sentences": "so the answer is 18, " * 1_000,
    "GSM8K lines": "#### 18\n" * 2_500,
}


@pytest.mark.parametrize("name", list(LONG))
def test_math_check_is_fast_on_long_completions(name):
    """Every evaluation completion is checked: a 20k-character one takes milliseconds (bound: 0.5 s), and a
    degenerate final answer is not handed to math-verify (which runs to its 5 s timeout on some)."""
    answers.check(r"\boxed{18}", "18")  # math-verify's import, once
    start = time.perf_counter()
    answers.check(LONG[name], "18")
    assert time.perf_counter() - start < 0.5


def test_tiny_task_keeps_its_exact_check():
    task = tasks.get_task("tiny")
    assert task.check("8+7=15,5+6+1=12,3+4+1=8;825", "825")
    assert not task.check("8+7=15,5+6+1=12,3+4+1=8;825 dollars", "825")
    assert not task.check("8+7=15;825.0", "825")


def _last_boxed_by_scans(text: str) -> tuple[int, str] | None:
    """The reference: a brace count from each box's opening, the last box that closes."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = (m.start(), text[m.end() : i - 1])
    return best


def test_last_boxed_agrees_with_a_scan_per_box():
    """The one-pass scan finds the box a brace count from each opening finds, on random nestings."""
    rng = random.Random(0)
    pieces = ["\\boxed{", "\\fbox {", "{", "}", "}", "1", "x", " ", "\\{"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(12)))
        assert answers.last_boxed(text) == _last_boxed_by_scans(text), text


def test_boxed_extraction_handles_nesting_and_last_box():
    assert answers.extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert answers.extract_boxed("no box") is None
    assert answers.extract_boxed(r"\boxed{unclosed") is None
