"""Which checkpoint a resumed run continues from: the newest complete one, each half-written one reported
with its reason and removed (opdkit/run/checkpoints.py). The end-to-end resumes are in test_whitebox.py and
test_students.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from opdkit.run import checkpoints


def _checkpoint(folder: Path, step: int, weights: str = "model.safetensors", state: bool = True) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / weights))
    torch.save({"state": torch.zeros(8)}, path / "optimizer.pt")
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _resume(folder: Path) -> tuple[Path | None, list[str]]:
    said: list[str] = []
    return checkpoints.resume_checkpoint(folder, say=said.append), said


def test_a_complete_newest_checkpoint_is_taken(tmp_path):
    _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 10)
    last, said = _resume(tmp_path)
    assert last == tmp_path / "checkpoint-10"  # by step, not by name order ("10" < "2")
    assert not any("skipping" in s for s in said)


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda p: (p / "trainer_state.json").unlink(), "no trainer_state.json"),
        (lambda p: (p / "trainer_state.json").write_text('{"global_st'), "trainer_state.json is unreadable"),
        (lambda p: _cut(p / "model.safetensors"), "a write cut short"),
        (lambda p: _cut(p / "model.safetensors", 0.001), "model.safetensors"),
        (lambda p: (p / "model.safetensors").unlink(), "no weights"),
        (lambda p: _cut(p / "optimizer.pt"), "optimizer.pt is not a whole torch archive"),
        (lambda p: (p / "optimizer.bin").write_bytes(b"PK\x03\x04cut"), "optimizer.bin"),  # FSDP's
    ],
)
def test_a_half_written_newest_checkpoint_is_skipped_said_and_removed(tmp_path, damage, reason):
    _checkpoint(tmp_path, 2)
    damage(_checkpoint(tmp_path, 4))
    last, said = _resume(tmp_path)
    assert last == tmp_path / "checkpoint-2"
    assert any("checkpoint-4" in s and reason in s for s in said), said
    assert not (tmp_path / "checkpoint-4").exists()  # it would count against save_total_limit
    assert (tmp_path / "checkpoint-2").is_dir()


def test_shards_and_adapters(tmp_path):
    sharded = _checkpoint(tmp_path, 2)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors is missing" in checkpoints.checkpoint_problem(sharded)
    assert (
        checkpoints.checkpoint_problem(_checkpoint(tmp_path, 3, weights="adapter_model.safetensors")) is None
    )


def test_no_complete_checkpoint_starts_from_the_beginning(tmp_path):
    _checkpoint(tmp_path, 2, state=False)
    last, said = _resume(tmp_path)
    assert last is None and "starts from the beginning" in said[-1]
    assert _resume(tmp_path / "missing") == (None, [])
