"""opdkit.run.files: atomic writes (a reader sees the old file or the new one, a failed write leaves nothing
behind), JSON that survives NaN and tensors, JSON lines."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from opdkit.run.files import atomic_path, atomic_write_text, json_safe, read_jsonl, write_jsonl


class Boom(Exception):
    pass


def test_atomic_write_text_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_text(path, "old")
    atomic_write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "grads.safetensors"
    path.write_text("old")
    with pytest.raises(Boom):
        with atomic_path(path) as tmp:
            assert tmp.parent == tmp_path and tmp.name != path.name
            tmp.write_text("half of the new")
            assert path.read_text() == "old"  # not replaced while the block runs
            raise Boom
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_folder_appears_whole_or_not_at_all(tmp_path):
    done = tmp_path / "traces"
    with atomic_path(done) as tmp:
        tmp.mkdir()
        (tmp / "data.arrow").write_text("rows")
        assert not done.exists()
    assert (done / "data.arrow").read_text() == "rows"
    failed = tmp_path / "other"
    with pytest.raises(Boom):
        with atomic_path(failed) as tmp:
            tmp.mkdir()
            (tmp / "data.arrow").write_text("half")
            raise Boom
    assert sorted(p.name for p in tmp_path.iterdir()) == ["traces"]


def test_json_safe_turns_what_json_cannot_hold_into_none_and_tensors_into_numbers():
    record = {
        "loss": float("nan"),
        "norm": [1.5, float("inf"), -float("inf")],
        "step": torch.tensor(3),
        "acc": np.float32(0.25),
        "nested": {"t": torch.tensor(float("nan")), "kept": "text", "tuple": (1, 2.0)},
        "vector": [torch.tensor(1.0), None],
    }
    safe = json_safe(record)
    assert safe == {
        "loss": None,
        "norm": [1.5, None, None],
        "step": 3,
        "acc": 0.25,
        "nested": {"t": None, "kept": "text", "tuple": [1, 2.0]},
        "vector": [1.0, None],
    }
    assert isinstance(safe["step"], int)
    json.loads(json.dumps(safe, allow_nan=False))  # strict JSON
    assert math.isnan(record["loss"])  # the caller's record is left alone


def test_jsonl_round_trips_and_a_missing_file_reads_as_no_records(tmp_path):
    records = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": float("nan"), "note": "ünïcode"}]
    write_jsonl(tmp_path / "m.jsonl", records)
    assert read_jsonl(tmp_path / "m.jsonl") == [
        {"step": 1, "loss": 0.5},
        {"step": 2, "loss": None, "note": "ünïcode"},
    ]
    (tmp_path / "gaps.jsonl").write_text('{"a": 1}\n\n  \n{"a": 2}\n')
    assert read_jsonl(tmp_path / "gaps.jsonl") == [{"a": 1}, {"a": 2}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []
    assert read_jsonl(str(tmp_path / "m.jsonl"))[0]["step"] == 1  # a str path too
