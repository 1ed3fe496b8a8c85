"""opdkit.tasks.math and the task registry (opdkit.tasks): each math task reads the reference answer of its
own row layout (GSM8K's `#### 18`, DAPO-Math's `reward_model.ground_truth`, MATH's boxed solution, an
assistant turn), and a dataset's name chooses its task."""

from __future__ import annotations

import datasets
import pytest

from opdkit import tasks
from opdkit.config import ConfigError
from opdkit.tasks import math, tiny

GSM8K, DAPO, MATH = (tasks.get_task(n) for n in ("gsm8k", "dapo-math", "math"))


def test_final_answer():
    assert math.final_answer("work\n#### 1,234 ") == "1,234"
    assert math.final_answer("so $\\boxed{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert math.final_answer(" 17 ") == "17"
    assert math.final_answer("first \\boxed{1}, then \\boxed{2}") == "2"  # the last box
    assert math.final_answer("\\boxed{3}\n#### 4") == "4"  # GSM8K's line wins over a box


def test_gsm8k_reads_the_number_after_its_marks():
    row = {"question": "How many?", "answer": "She sells 12 * 100 = <<12*100=1200>>1200.\n#### 1,234"}
    assert GSM8K.reference_answer(row, None) == "1,234"
    assert GSM8K.reference_answer({"question": "q", "answer": "72"}, None) == "72"  # a bare answer column
    assert GSM8K.reference_answer({"question": "q", "solution": "so \\boxed{7}"}, None) == "7"
    assert GSM8K.check("12 * 100 = 1200, so she has \\boxed{1234}.", "1,234")


def test_dapo_math_reads_the_ground_truth():
    row = {
        "prompt": [{"role": "user", "content": "q"}],
        "reward_model": {"ground_truth": "34", "style": "rule"},
    }
    assert DAPO.reference_answer(row, None) == "34"
    boxed = {"prompt": [], "reward_model": {"ground_truth": "\\boxed{\\frac{3}{4}}"}}
    assert DAPO.reference_answer(boxed, None) == "\\frac{3}{4}"
    blank = {"prompt": [], "reward_model": {"ground_truth": " "}, "solution": "so \\boxed{9}"}
    assert DAPO.reference_answer(blank, None) == "9"  # an empty ground truth: the next source
    assert DAPO.check("6 * 5 + 4\nAnswer: 34", "34")


def test_math_reads_a_boxed_solution_or_the_assistant_turn():
    row = {"problem": "Half of one?", "solution": "Thus $\\boxed{\\frac{1}{2}}$."}
    assert MATH.reference_answer(row, None) == "\\frac{1}{2}"
    assert MATH.reference_answer({"messages": []}, "It is \\boxed{2}.") == "2"
    assert MATH.reference_answer({"messages": []}, " just 5 ") == "just 5"  # no box: all of it
    assert (
        MATH.reference_answer({"answer": "6", "solution": "\\boxed{7}"}, None) == "6"
    )  # the answer column first
    assert MATH.reference_answer({}, None) == ""
    assert MATH.check("so the answer is \\boxed{0.5}", "\\frac{1}{2}")


@pytest.mark.parametrize(
    "dataset, task",
    [
        ("tiny", "tiny"),
        ("data/gsm8k-main-test.parquet", "gsm8k"),
        ("openai/gsm8k", "gsm8k"),
        ("madrylab/GSM8K-Platinum", "gsm8k"),
        ("data/dapo-math-17k.parquet", "dapo-math"),
        ("BytedTsinghua-SIA/DAPO-Math-17k", "dapo-math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("data/problems.jsonl", "math"),
        ("tiny.parquet", "math"),  # only the name "tiny" is the tiny world's own prompts
    ],
)
def test_a_dataset_chooses_its_task(dataset, task):
    chosen = tasks.for_dataset(dataset)
    assert chosen.name == task and type(chosen) is tasks.TASKS[task]


def test_every_task_is_registered_under_its_own_name():
    assert {name: cls.name for name, cls in tasks.TASKS.items()} == {n: n for n in tasks.TASKS}
    assert tasks.for_dataset(tiny.DATASET).name == "tiny"


def test_an_unknown_task_is_a_config_error_listing_the_known_ones():
    with pytest.raises(
        ConfigError,
        match=r"unknown task 'gsm9k'; valid: \['dapo-math', 'gsm8k', 'math', 'tiny', 'tiny-tools'\]",
    ):
        tasks.get_task("gsm9k")


def test_gsm8k_prompts_load_with_the_numbers_after_the_marks(tmp_path):
    questions = ["Ann has 3 apples and buys 15. How many?", "What is 1000 + 234?", "Half of 6?"]
    solutions = ["3 + 15 = <<3+15=18>>18\n#### 18", "1000 + 234 = 1234\n#### 1,234", "6 / 2 = 3\n#### 3"]
    path = tmp_path / "gsm8k-main-test.parquet"
    datasets.Dataset.from_dict({"question": questions, "answer": solutions}).to_parquet(str(path))
    task = tasks.for_dataset(str(path))
    ds = task.load_prompts(str(path), subset_size=-1, seed=0)
    assert task.name == "gsm8k" and ds.column_names == ["messages", "answer"]
    got = {r["messages"][0]["content"]: r["answer"] for r in ds}
    assert got == dict(zip(questions, ["18", "1,234", "3"]))
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in ds)
