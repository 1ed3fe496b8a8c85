"""opdkit.run.folders: one folder per run, nothing silently overwritten or resumed with other settings, only
rank 0 writing. (Where new runs go: test_layout.py's test_runs_go_under_the_working_folder_or_opdkit_runs.)"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
import yaml

from opdkit.config import ConfigError, RunFields
from opdkit.run import folders
from opdkit.run.folders import RunDir, prepare_run_dir


@dataclass
class ToyConfig(RunFields):
    job = "toy"

    learning_rate: float = 1e-3


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


def test_print0_prints_on_rank_zero_only(monkeypatch, capsys):
    folders.print0("from rank 0")
    monkeypatch.setenv("RANK", "1")
    folders.print0("from rank 1")
    assert capsys.readouterr().out == "from rank 0\n" and folders.rank() == 1


def test_new_run_paths_are_named_by_mode_and_time_and_never_repeat(tmp_path):
    a, b = (folders.new_run_path("toy", "tiny", tmp_path) for _ in range(2))
    assert a.parent == b.parent == tmp_path / "toy" and a != b
    assert re.fullmatch(r"tiny-\d{8}-\d{6}-[0-9a-f]{4}", a.name), a.name


def test_a_non_empty_folder_needs_overwrite_or_resume(tmp_path):
    path = tmp_path / "run"
    assert prepare_run_dir(path) == path and path.is_dir()
    assert prepare_run_dir(path) == path  # empty: used as it is
    (path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ConfigError, match="is not empty; pass overwrite=True"):
        prepare_run_dir(path)
    assert prepare_run_dir(path, resume=True) == path and (path / "metrics.jsonl").is_file()  # kept
    assert prepare_run_dir(path, overwrite=True) == path and list(path.iterdir()) == []  # cleared


def test_resume_needs_an_earlier_run_and_a_file_is_no_folder(tmp_path):
    with pytest.raises(ConfigError, match="holds no earlier run"):
        prepare_run_dir(tmp_path / "new", resume=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        prepare_run_dir(tmp_path / "file")


def test_create_writes_the_resolved_config_and_sets_run_dir(tmp_path):
    cfg = ToyConfig(seed=3)
    run = RunDir.create(cfg, job="toy", mode="tiny", root=tmp_path)
    assert run.path.parent == tmp_path / "toy" and run.writer and cfg.run_dir == str(run.path)
    config = yaml.safe_load((run.path / "config.yaml").read_text())
    assert config == {"job": "toy", "mode": "tiny", **vars(cfg)}
    assert run.read_config("toy") == config
    with pytest.raises(ConfigError, match="is a 'toy' run, not a whitebox run"):
        run.read_config("whitebox")
    with pytest.raises(FileNotFoundError, match="no config.yaml"):
        RunDir(tmp_path).read_config()


def test_resume_refuses_other_settings_and_takes_the_same_ones(tmp_path):
    first = RunDir.create(ToyConfig(run_dir=str(tmp_path / "run")), job="toy", mode="tiny")
    first.log({"step": 1})
    with pytest.raises(ConfigError, match=r"differ from the run .*\['learning_rate'\]"):
        RunDir.create(
            ToyConfig(run_dir=str(first.path), resume=True, learning_rate=1.0), job="toy", mode="tiny"
        )
    again = RunDir.create(ToyConfig(run_dir=str(first.path), resume=True), job="toy", mode="tiny")
    assert again.path == first.path and again.read_jsonl() == [{"step": 1}]


@dataclass
class RenamedConfig(RunFields):
    trace_batch_size: int = 64
    rollout_max_new_tokens: int = 1024


def test_a_run_saved_under_old_setting_names_reads_and_resumes_under_the_new_ones(tmp_path):
    """A config.yaml written before a rename (`config.RENAMED`): read under today's names, an old name that
    split going to each of its new names, and a resume with the same values is taken."""
    first = RunDir.create(RenamedConfig(run_dir=str(tmp_path / "run")), job="toy", mode="tiny")
    saved = yaml.safe_load((first.path / "config.yaml").read_text())
    old = {k: v for k, v in saved.items() if k not in ("trace_batch_size", "rollout_max_new_tokens")}
    old |= {"gen_batch_size": 8, "max_new_tokens": 40}
    (first.path / "config.yaml").write_text(yaml.safe_dump(old))
    config = first.read_config("toy")
    assert "gen_batch_size" not in config and "max_new_tokens" not in config
    assert (config["trace_batch_size"], config["rollout_max_new_tokens"], config["trace_max_new_tokens"]) == (
        8,
        40,
        40,
    )
    again = RenamedConfig(run_dir=str(first.path), resume=True, trace_batch_size=8, rollout_max_new_tokens=40)
    assert RunDir.create(again, job="toy", mode="tiny").path == first.path
    with pytest.raises(ConfigError, match=r"differ from the run .*\['trace_batch_size'\]"):
        RunDir.create(
            RenamedConfig(run_dir=str(first.path), resume=True, rollout_max_new_tokens=40),
            job="toy",
            mode="tiny",
        )


def test_logs_are_cut_back_to_the_checkpoint_a_resumed_run_continues_from(tmp_path):
    run = RunDir(tmp_path)
    for step in (1, 2, 3, 4):
        run.log({"step": step, "loss": 1.0 / step})
        run.log({"step": step, "text": "x"}, "samples.jsonl")
    run.log({"note": "no step"})  # counts as step 0: kept
    run.truncate_logs(2)
    assert [r.get("step") for r in run.read_jsonl()] == [1, 2, None]
    assert [r["step"] for r in run.read_jsonl("samples.jsonl")] == [1, 2]


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    run = RunDir.attach(tmp_path)
    assert not run.writer
    run.log({"step": 1})
    run.write_summary({"a": 1})
    run.write_env(world_size=2, device="cpu")
    run.truncate_logs(0)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("RANK", "0")
    assert RunDir.attach(tmp_path).writer


def test_summary_env_and_figures(tmp_path):
    run = RunDir(tmp_path)
    run.write_summary({"accuracy": float("nan"), "steps": 3})
    assert run.read_summary() == {"accuracy": None, "steps": 3}
    run.write_env(world_size=2, device="cpu")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["world_size"] == 2 and env["device"] == "cpu" and "torch" in env["versions"]
    assert run.figure("loss") == tmp_path / "figures" / "loss.png" and (tmp_path / "figures").is_dir()
