"""opdkit.run.cli, the jobs' `python -m` entry points: `--mode` and `--set key=value` (values read as YAML),
and what a run from the command line prints and draws. (Every job's `--help`: test_config.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from opdkit.config import RunFields, setting
from opdkit.run.cli import parse_cli, run_from_cli
from opdkit.run.folders import RunDir


@dataclass
class ToyConfig(RunFields):
    job = "toy"

    max_steps: int = setting(10, "optimizer steps")


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


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
