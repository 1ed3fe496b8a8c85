"""opdkit.run.cli, the jobs' `python -m` entry points: `--mode` and `--set key=value` (values read as YAML),
and what a run from the command line prints and draws; bad input is one line on stderr, `error: ...`, exit
status 2, before any slow work (no prompt measured, nothing written), `--debug` shows the traceback, and a bug
keeps its own. (Every job's `--help`: test_config.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from opdkit.config import ConfigError, MissingInput, RunFields, setting
from opdkit.run.cli import parse_cli, run_from_cli
from opdkit.run.folders import RunDir


@dataclass
class ToyConfig(RunFields):
    job = "toy"

    max_steps: int = setting(10, "optimizer steps")


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    # The toy job has no presets in params/: its settings are the overrides (the jobs' own: test_settings.py).
    monkeypatch.setattr("opdkit.run.cli.load_config", lambda cls, mode, overrides: cls(**overrides))


def test_set_values_are_read_as_yaml():
    argv = ["--mode", "sanity", "--set", "max_steps=50", "lams=[0, 0.1]", "report_to=none", "dry_run=true"]
    argv += ["run_dir=runs/a=b", "plan_gpu_memory_gb=8e1"]
    mode, overrides = parse_cli(ToyConfig, "a toy job", argv)
    assert mode == "sanity"
    assert overrides == {
        "max_steps": 50,
        "lams": [0, 0.1],
        "report_to": "none",
        "dry_run": True,
        "run_dir": "runs/a=b",  # split at the first '='
        "plan_gpu_memory_gb": "8e1",  # YAML 1.1 reads a string; load_config makes it the field's float
    }
    assert parse_cli(ToyConfig, "a toy job", []) == ("tiny", {})


def test_set_given_twice_keeps_both():
    argv = ["--set", "max_steps=5", "--set", "report_to=none", "max_steps=7"]
    assert parse_cli(ToyConfig, "a toy job", argv)[1] == {"max_steps": 7, "report_to": "none"}


def test_a_set_without_a_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(ToyConfig, "a toy job", ["--set", "max_steps"])
    assert (
        exit_.value.code == 2 and "--set takes KEY=VALUE pairs; got ['max_steps']" in capsys.readouterr().err
    )


def test_help_names_the_entry_point_and_lists_the_fields(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(ToyConfig, "a toy job", ["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: python -m opdkit.toy")
    assert "a toy job" in out and any(line.split()[:2] == ["max_steps", "10"] for line in out.splitlines())


def test_a_run_draws_its_figures_and_says_where_it_is(tmp_path, capsys):
    asked, drawn = [], []

    def run(mode, overrides):
        asked.append((mode, overrides))
        return RunDir(tmp_path)

    done = run_from_cli(ToyConfig, "a toy job", run, drawn.append, ["--set", "max_steps=2"])
    assert done.path == tmp_path and asked == [("tiny", {"max_steps": 2})]
    assert [d.path for d in drawn] == [tmp_path]
    assert capsys.readouterr().out == f"run directory: {tmp_path}\n"


def test_a_dry_run_prints_nothing_after_the_plan_and_draws_nothing(capsys):
    drawn = []
    assert run_from_cli(ToyConfig, "a toy job", lambda mode, overrides: None, drawn.append, []) is None
    assert drawn == [] and capsys.readouterr().out == ""


def test_only_the_writing_rank_draws(tmp_path):
    drawn = []
    run_from_cli(ToyConfig, "a toy job", lambda m, o: RunDir(tmp_path, writer=False), drawn.append, [])
    assert drawn == []


def job_cli(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "opdkit.whitebox", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )
    return proc, time.monotonic() - t0


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            ["bogus=1"],
            "error: unknown setting 'bogus' for whitebox; python -m opdkit.whitebox --help lists them.",
        ),
        (["beta=2"], "error: beta=2.0 is above its maximum 1.0"),
        (
            ["global_batch_size=6", "per_device_train_batch_size=4"],
            "error: global_batch_size=6 prompts per optimizer step do not split",
        ),
        (["dataset_path=missing.parquet"], "error: no file or folder at 'missing.parquet'"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, settings, message):
    run_dir = tmp_path / "run"
    proc, seconds = job_cli("--set", *settings, f"run_dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "measuring prompts" not in proc.stderr
    assert not run_dir.exists()
    # Importing torch, transformers and datasets is most of it (about 15 s on 2 busy cores); measuring the
    # tiny preset's 20,000 prompts alone would add 7 s more.
    assert seconds < 120


def test_debug_shows_the_traceback(tmp_path):
    proc, _ = job_cli("--set", "bogus=1", "--debug", cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigError: unknown setting 'bogus'" in proc.stderr


def test_only_bad_input_is_shortened(capsys):
    """A ConfigError (and its kinds: a missing file, a tokenizer mismatch, ...) becomes `error: ...`; any
    other exception is a bug, and goes on up with its traceback."""

    def failing(exc):
        def run(mode, overrides):
            raise exc

        return run

    for exc in (ConfigError("bad\nvalue"), MissingInput("no such file")):
        with pytest.raises(SystemExit) as stop:
            run_from_cli(ToyConfig, "", failing(exc), lambda run: None, [])
        assert stop.value.code == 2
        assert capsys.readouterr().err == f"error: {' '.join(str(exc).split())}\n"
    with pytest.raises(ZeroDivisionError):
        run_from_cli(ToyConfig, "", failing(ZeroDivisionError("bug")), lambda run: None, [])
    with pytest.raises(SystemExit) as stop:  # a --set value YAML cannot read
        run_from_cli(ToyConfig, "", failing(AssertionError("not run")), lambda run: None, ["--set", "a=[1,"])
    err = capsys.readouterr().err
    assert (
        stop.value.code == 2
        and err.startswith("error: --set a=[1, is not a YAML value")
        and err.count("\n") == 1
    )


def test_a_bad_input_error_renders_as_one_line_in_a_notebook():
    """IPython shows `_render_traceback_` instead of the traceback (in papermill too: test_notebooks.py)."""
    err = MissingInput("no file\nat x")
    assert err._render_traceback_() == ["MissingInput: no file at x"]
    assert isinstance(err, FileNotFoundError) and isinstance(err, ValueError)
