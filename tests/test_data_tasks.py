"""Held-out evaluation sets never share a prompt with the training prompts, whatever subset_size is."""

import pytest

from opdkit.config import ConfigError
from opdkit.data import prompts, tasks


def _texts(messages) -> list[str]:
    return [m[-1]["content"] for m in messages]


@pytest.mark.parametrize("subset_size,eval_size", [(-1, 3), (-1, 1), (5, 3), (9, 3), (5, 100)])
def test_math_eval_rows_are_apart_from_training(dapo_parquet, subset_size, eval_size):
    task, path = tasks.get_task("math"), str(dapo_parquet)
    train = _texts(task.train_prompts(path, "train", subset_size, eval_size, 42)["messages"])
    held, answers = task.eval_rows(path, "train", subset_size, eval_size, 42)
    everything = _texts(prompts.load_prompts(path, "train", -1, 42)["messages"])
    assert not set(train) & set(_texts(held))
    assert len(held) == len(answers) == min(eval_size, len(everything) - len(train))
    expected_train = len(everything) - eval_size if subset_size == -1 else subset_size
    assert len(train) == expected_train and set(train) | set(_texts(held)) <= set(everything)


def test_whole_file_with_eval_leaves_the_eval_rows_out(dapo_parquet):
    """subset_size=-1 used to train on every row and evaluate on the last eval_size of them."""
    task = tasks.get_task("math")
    train = task.train_prompts(str(dapo_parquet), "train", -1, 4, 0)
    held, _ = task.eval_rows(str(dapo_parquet), "train", -1, 4, 0)
    assert len(train) == 8 and len(held) == 4
    assert not set(_texts(train["messages"])) & set(_texts(held))


@pytest.mark.parametrize("subset_size,eval_size", [(-1, 12), (12, 1), (20, 5)])
def test_no_room_for_held_out_rows_is_an_error(dapo_parquet, subset_size, eval_size):
    with pytest.raises(ConfigError, match="too few"):
        tasks.get_task("math").eval_rows(str(dapo_parquet), "train", subset_size, eval_size, 42)


def test_whitebox_prepare_uses_the_split(dapo_parquet, tiny_tokenizer, monkeypatch):
    from opdkit.jobs.whitebox import job

    monkeypatch.setattr(job, "load_tokenizer", lambda name: tiny_tokenizer)
    monkeypatch.setattr(job, "check_tokenizers", lambda a, b: None)
    prep = job.prepare(
        "tiny",
        {"dataset_path": str(dapo_parquet), "subset_size": -1, "eval_size": 2, "max_prompt_length": 100_000},
    )
    assert not set(_texts(prep.train_messages)) & set(_texts(prep.eval_messages))
    assert len(prep.train_dataset) == 10 and len(prep.eval_messages) == 2
