"""Work spread over processes (opdkit.run.spread): round-robin shares in order, a process of its own that
keeps one GPU and forgets the launcher's torch.distributed settings, and an item that fails written down
with its traceback while the caller goes on. End to end (04's points over two processes):
tests/test_jobs_antidistill_points.py."""

from __future__ import annotations

import json
import os

from opdkit.run import spread


def test_assignment_is_round_robin_in_order():
    names = [f"temperature-lam0-tau{t}" for t in (1, 1.1, 1.2, 1.3, 1.4)]
    assert spread.assign(names, 2) == [[names[i] for i in (0, 2, 4)], [names[i] for i in (1, 3)]]
    assert spread.assign(names, 1) == [names]
    assert spread.assign(names[:1], 3) == [names[:1], [], []]  # more processes than items: some idle


def test_own_process_keeps_one_gpu_and_forgets_the_launcher(monkeypatch):
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert spread.own_process() == (1, 2)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    assert not [k for k in spread.LAUNCHER_ENV if k in os.environ]


def test_one_process_changes_nothing(monkeypatch):
    for key in spread.LAUNCHER_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert spread.own_process() == (0, 1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_a_failing_item_is_written_down_and_a_later_success_clears_it(tmp_path):
    result_file = tmp_path / "item" / "point.json"
    recovered = []

    def boom() -> dict:
        raise RuntimeError("injected failure")

    failed = spread.run_safely(result_file, boom, {"name": "item"}, lambda: recovered.append(True))
    assert failed["status"] == "failed" and failed["name"] == "item" and recovered == [True]
    assert "RuntimeError: injected failure" in failed["error"]
    assert "Traceback" in (tmp_path / "item" / spread.ERROR_FILE).read_text()
    assert spread.read_result(result_file) == failed
    done = spread.run_safely(result_file, lambda: {"name": "item", "value": 3}, {"name": "item"})
    assert done == {"name": "item", "value": 3, "status": "done"}
    assert json.loads(result_file.read_text()) == done
    assert not (tmp_path / "item" / spread.ERROR_FILE).exists()
    assert spread.read_result(tmp_path / "never" / "point.json") is None
