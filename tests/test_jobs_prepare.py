"""Cheap checks first, in the original's order: the data files, then the tokenizers, then the models. A
missing file is reported as missing before any download is attempted; a file that cannot be read is
reported with its path and what it was expected to be."""

from __future__ import annotations

import datasets
import pytest

from opdkit import models, tiny
from opdkit.data import prompts
from opdkit.jobs import antidistill
from opdkit.jobs.savegrad import job as savegrad
from opdkit.jobs.whitebox import job as whitebox

TINY = {"teacher_model": tiny.resolve("tiny:teacher")}
JOBS = [  # (prepare, mode, the overrides that point every model at a local folder)
    (
        whitebox.prepare,
        "full",
        {"student_model": tiny.resolve("tiny:student"), "subset_size": 6, "eval_size": 2, **TINY},
    ),
    (savegrad.prepare, "full", {"proxy_model": tiny.resolve("tiny:student"), **TINY}),
    (savegrad.prepare, "ads-paper", {"proxy_model": tiny.resolve("tiny:student"), **TINY}),
    (
        antidistill.prepare,
        "full",
        {
            "proxy_model": tiny.resolve("tiny:student"),
            "student_model": tiny.resolve("tiny:student"),
            "student_tokenizer": "",
            **TINY,
        },
    ),
    (
        antidistill.prepare,
        "ads-paper",
        {
            "proxy_model": tiny.resolve("tiny:student"),
            "student_model": tiny.resolve("tiny:student"),
            "student_tokenizer": "",
            **TINY,
        },
    ),
]


class Stop(Exception):
    pass


@pytest.fixture
def events(monkeypatch):
    """Records data reads and tokenizer loads; no Hub dataset may be asked for, and the first tokenizer ends
    the run (what comes after it is the models' and the jobs' own business)."""
    seen: list[str] = []
    read = prompts.load_raw

    def load_raw(path, split):
        seen.append(f"data {path}")
        return read(path, split)

    def tokenizer(name, *args, **kwargs):
        seen.append("tokenizer")
        raise Stop

    def hub(*args, **kwargs):
        raise AssertionError(f"a Hub dataset was asked for: {args}")

    monkeypatch.setattr(prompts, "load_raw", load_raw)
    monkeypatch.setattr(models, "_LOADED", {})  # none loaded yet in this process
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", tokenizer)
    monkeypatch.setattr(datasets, "load_dataset", hub)
    return seen


@pytest.mark.parametrize("prepare,mode,over", JOBS)
def test_missing_data_file_is_reported_before_any_tokenizer(prepare, mode, over, events, tmp_path):
    missing = str(tmp_path / "data" / "nope.parquet")
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        prepare(mode, {**over, "dataset_path": missing})
    assert "tokenizer" not in events


@pytest.mark.parametrize("prepare,mode,over", JOBS)
def test_data_files_are_read_before_tokenizers(prepare, mode, over, events, dapo_parquet):
    extra = (  # one file for both sets: the evaluation rows are the ones not trained on
        {
            "eval_dataset_path": str(dapo_parquet),
            "eval_dataset_split": "train",
            "subset_size": 6,
            "grads_mode": "tiny",  # the presets' savegrad reads data/ files this test does not have
        }
        if prepare is antidistill.prepare
        else {}
    )
    with pytest.raises(Stop):
        prepare(mode, {**over, **extra, "dataset_path": str(dapo_parquet)})
    first_tokenizer = events.index("tokenizer")
    assert first_tokenizer > 0 and all(e.startswith("data ") for e in events[:first_tokenizer])
    assert all(not e.startswith("data ") for e in events[first_tokenizer:])


def test_missing_eval_file_is_reported_before_any_tokenizer(events, dapo_parquet, tmp_path):
    over = {
        **JOBS[3][2],
        "dataset_path": str(dapo_parquet),
        "eval_dataset_path": str(tmp_path / "test.parquet"),
    }
    with pytest.raises(FileNotFoundError, match="test.parquet"):
        antidistill.prepare("full", over)
    assert "tokenizer" not in events


@pytest.mark.parametrize("content", ["garbage", "half"])
def test_corrupt_parquet_names_its_path(content, dapo_parquet, tmp_path):
    bad = tmp_path / "dapo-math-17k-unique.parquet"
    whole = dapo_parquet.read_bytes()
    bad.write_bytes(b"not a parquet file at all" if content == "garbage" else whole[: len(whole) // 2])
    with pytest.raises(
        prompts.UnreadableData, match=rf"cannot read '{bad}' as a \.parquet file.*re-create it"
    ):
        prompts.load_prompts(str(bad))


@pytest.mark.parametrize(
    "name,text,expected",
    [("t.jsonl", '{"prompt": "a"\n{{{', "a .jsonl file"), ("t.json", "[{]", "a .json file")],
)
def test_corrupt_json_names_its_path(tmp_path, name, text, expected):
    (tmp_path / name).write_text(text)
    with pytest.raises(prompts.UnreadableData, match=rf"{name}' as {expected}"):
        prompts.load_prompts(str(tmp_path / name))


def test_corrupt_file_stops_a_job_before_tokenizers(events, tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"PAR1 broken")
    with pytest.raises(prompts.UnreadableData, match="x.parquet"):
        whitebox.prepare("full", {**JOBS[0][2], "dataset_path": str(bad)})
    assert "tokenizer" not in events
