"""The math task's check (math-verify): the answer forms real GSM8K / DAPO-Math completions take are right,
wrong answers stay wrong, in the main thread, in worker threads and in forked processes."""

import multiprocessing
import threading

import pytest

from opdkit.data import answers, tasks

WORK = "Let me think. 3 * 6 = 18, then 18 + 5 = 23, and 23 - 5 = 18.\n"
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


def test_tiny_task_keeps_its_exact_check():
    task = tasks.get_task("tiny")
    assert task.check("8+7=15,5+6+1=12,3+4+1=8;825", "825")
    assert not task.check("8+7=15,5+6+1=12,3+4+1=8;825 dollars", "825")
    assert not task.check("8+7=15;825.0", "825")
