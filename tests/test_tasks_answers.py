"""The math task's check (math-verify): the answer forms real GSM8K / DAPO-Math completions take are right,
wrong answers stay wrong, in the main thread, in worker threads and in forked processes."""

import multiprocessing
import threading

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


def test_tiny_task_keeps_its_exact_check():
    task = tasks.get_task("tiny")
    assert task.check("8+7=15,5+6+1=12,3+4+1=8;825", "825")
    assert not task.check("8+7=15,5+6+1=12,3+4+1=8;825 dollars", "825")
    assert not task.check("8+7=15;825.0", "825")


def test_boxed_extraction_handles_nesting_and_last_box():
    assert answers.extract_boxed(r"so \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert answers.extract_boxed("no box") is None
    assert answers.extract_boxed(r"\boxed{unclosed") is None
