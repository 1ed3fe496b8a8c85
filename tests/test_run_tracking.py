"""report_to for every job: metrics and sample tables reach the tracker (a recording stand-in, and trackio
and tensorboard for real when installed)."""

from __future__ import annotations

import contextvars
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from opdkit.config import ConfigError
from opdkit.jobs import antidistill, savegrad
from opdkit.run.tracking import Tracker, check_report_to


class _Config(dict):
    def update(self, values, allow_val_change=False):  # trackio's run config, as transformers calls it
        super().update(values)


class FakeTrackio(types.ModuleType):
    """Records what a job sends to `trackio` (also through transformers' trackio integration)."""

    def __init__(self):
        super().__init__("trackio")
        self.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
        self.__version__ = "0.43.0"
        self.inits, self.logs, self.finished = [], [], 0
        self.config = _Config()
        self.context_vars = types.SimpleNamespace(
            current_space_id=contextvars.ContextVar("space", default=None),
            current_project=contextvars.ContextVar("project", default=None),
        )

    def init(self, project, name=None, config=None, **_):
        self.inits.append((project, name, config))

    def log(self, metrics, step=None):
        self.logs.append((step, metrics))

    def finish(self):
        self.finished += 1

    class Table:
        def __init__(self, columns=None, data=None):
            self.columns, self.data = columns, data


@pytest.fixture
def fake_trackio(monkeypatch):
    fake = FakeTrackio()
    monkeypatch.setitem(sys.modules, "trackio", fake)
    return fake


def test_report_to_is_checked_before_anything_is_written(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not one of"):
        savegrad.prepare("tiny", {"report_to": "mlflow", "run_dir": str(tmp_path / "r")})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match="wandb is not installed; pip install wandb"):
        check_report_to("wandb")
    assert not (tmp_path / "r").exists()


def test_save_grad_sends_its_summary_and_a_traces_table(tmp_path, fake_trackio):
    run = savegrad.run("tiny", {"subset_size": 8, "report_to": "trackio", "run_dir": str(tmp_path / "g")})
    ((project, name, config),) = fake_trackio.inits
    assert project == "opdkit" and name.endswith("/g") and config["subset_size"] == 8
    metrics = {k for _, m in fake_trackio.logs for k in m}
    assert {"grad_norm", "proxy_loss"} <= metrics
    table = next(m["traces"] for _, m in fake_trackio.logs if "traces" in m)
    assert table.columns == ["prompt", "trace", "answer", "correct"] and len(table.data) == 8
    assert fake_trackio.finished == 1 and run.read_summary()["status"] == "done"


@pytest.mark.slow
def test_antidistill_sends_every_point_and_a_points_table(tmp_path, fake_trackio):
    grads = savegrad.run("tiny", {"subset_size": 8, "run_dir": str(tmp_path / "g")})
    antidistill.run(
        "tiny",
        {
            "grads_run": str(grads.path),
            "lams": [0.0, 0.1],
            "answer_lams": [],
            "temperatures": [],
            "subset_size": 16,
            "eval_size": 8,
            "sft_max_steps": 2,
            "report_to": "trackio",
            "run_dir": str(tmp_path / "a"),
        },
    )
    # The job's own rows carry the point's lam (each student's Trainer also reports its SFT and final scores).
    steps = [step for step, m in fake_trackio.logs if "student_accuracy" in m and "lam" in m]
    assert steps == [1, 2]
    table = next(m["points"] for _, m in fake_trackio.logs if "points" in m)
    assert [row[0] for row in table.data] == ["ads-lam0-t1", "ads-lam0.1-t1"] or len(table.data) == 2


def _trackio_rows(store: Path) -> str:
    import sqlite3

    dbs = list(store.rglob("*.db"))
    assert dbs, list(store.rglob("*"))
    with sqlite3.connect(dbs[0]) as db:
        return " ".join(str(r) for r in db.execute("select * from metrics").fetchall())


@pytest.mark.slow
def test_whitebox_reports_through_the_trainer_with_sample_tables(tmp_path):
    """02 goes through transformers' own trackio integration; the sample tables join the same run."""
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "opdkit.whitebox",
        "--set",
        "max_steps=2",
        "eval_size=8",
        "eval_every=1",
        "eval_every_size=4",
        "sample_every=1",
        "report_to=trackio",
        f"run_dir={tmp_path / 'w'}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _trackio_rows(tmp_path / "trackio")
    for key in ("train/loss", "train/grad_norm", "eval/accuracy", "samples"):
        assert key in rows, key


def test_tensorboard_writes_scalars_and_a_text_table_under_the_run(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = types.SimpleNamespace(path=tmp_path, writer=True)
    tracker = Tracker.start("tensorboard", run)
    tracker.log({"loss": 0.5, "name": "text is left out"}, step=3)
    tracker.table("samples", [{"prompt": "1+2", "completion": "3|4"}], step=3)
    tracker.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.value for e in events.Scalars("loss")] == [0.5]
    assert "samples/text_summary" in events.Tags()["tensors"]


def test_trackio_for_real_keeps_the_metrics_locally(tmp_path, monkeypatch):
    pytest.importorskip("trackio")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    code = (
        "import types, pathlib, trackio\n"
        "from opdkit.run.tracking import Tracker\n"
        f"run = types.SimpleNamespace(path=pathlib.Path({str(tmp_path / 'run')!r}), writer=True)\n"
        "t = Tracker.start('trackio', run, config={'seed': 1}, project='opdkit-test')\n"
        "t.log({'loss': 0.25}, step=1); "
        "t.table('samples', [{'prompt': 'p', 'ok': True}], step=1); t.finish()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True)
    rows = _trackio_rows(tmp_path / "trackio")
    assert "loss" in rows and "0.25" in rows and "samples" in rows
