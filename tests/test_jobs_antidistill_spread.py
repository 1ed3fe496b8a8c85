"""antidistill's points spread over processes: 2 gloo processes give the summary 1 process gives, a
point that fails is reported with its traceback while the others finish, and resume runs only the
unfinished ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opdkit.jobs import antidistill, savegrad
from opdkit.jobs.antidistill import spread
from opdkit.jobs.antidistill.sweep import Point

SMALL = {
    "subset_size": 16,
    "eval_size": 16,
    "sft_max_steps": 3,
    "sft_batch_size": 8,
    "sft_micro_batch_size": 4,
    "lams": [0.0, 0.2],
    "answer_lams": [0.1],
    "temperatures": [1.5],
}
FAILING = "temperature-lam0-tau1"


@pytest.fixture(scope="module")
def grads_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sweep") / "grads"
    savegrad.run("tiny", {"run_dir": str(path), "subset_size": 32})
    return path


def _entries(summary: dict) -> list[dict]:
    """The points without their timings."""
    out = []
    for p in summary["points"]:
        runs = [{k: v for k, v in r.items() if k != "seconds"} for r in p["runs"]]
        out.append({**{k: v for k, v in p.items() if k != "seconds"}, "runs": runs})
    return out


def test_assignment_is_round_robin_in_sweep_order():
    points = [Point("temperature", 0.0, t) for t in (1.0, 1.1, 1.2, 1.3, 1.4)]
    assert spread.assign(points, 2) == [[points[i].name for i in (0, 2, 4)], [points[i].name for i in (1, 3)]]
    assert spread.assign(points, 1) == [[p.name for p in points]]


@pytest.mark.slow
def test_two_processes_give_one_process_summary_and_a_failure_waits_for_resume(
    grads_run, tmp_path, monkeypatch
):
    one = antidistill.run("tiny", {**SMALL, "grads_run": str(grads_run), "run_dir": str(tmp_path / "one")})
    expected = one.read_summary()
    assert expected["status"] == "done" and expected["num_processes"] == 1 and len(expected["points"]) == 4

    real = spread.run_point

    def flaky(point, *args):
        if point.name == FAILING:
            raise RuntimeError("injected failure")
        return real(point, *args)

    monkeypatch.setattr(spread, "run_point", flaky)  # forked processes inherit it
    over = {**SMALL, "grads_run": str(grads_run), "run_dir": str(tmp_path / "two"), "num_processes": 2}
    two = antidistill.run("tiny", over)
    summary = two.read_summary()
    assert summary["status"] == "incomplete" and summary["num_processes"] == 2
    [failed] = summary["failed_points"]
    assert failed["name"] == FAILING and "RuntimeError: injected failure" in failed["error"]
    assert "Traceback" in (two.path / "points" / FAILING / "error.txt").read_text()
    # the failing point was process 0's first: process 0's other point ran after it
    assert [p["name"] for p in summary["points"]] == [p["name"] for p in expected["points"][1:]]
    assert _entries(summary) == _entries(expected)[1:]
    assert summary["student_accuracy_before"] == expected["student_accuracy_before"]

    monkeypatch.setattr(spread, "run_point", real)
    kept = {
        p["name"]: (two.path / "points" / p["name"] / "point.json").stat().st_mtime_ns
        for p in summary["points"]
    }
    again = antidistill.run("tiny", {**over, "resume": True}).read_summary()
    assert again["status"] == "done" and again["failed_points"] == [] and again["num_processes"] == 1
    assert kept == {n: (two.path / "points" / n / "point.json").stat().st_mtime_ns for n in kept}
    assert not (two.path / "points" / FAILING / "error.txt").exists()
    assert _entries(again) == _entries(expected)
    records = [json.loads(line) for line in (two.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["name"] for r in records if "name" in r] == [p["name"] for p in expected["points"]]
    assert all(len(r["sft_loss"]) == 3 for r in records if "sft_loss" in r)


def test_explain_names_the_failed_points():
    from opdkit.jobs.antidistill import report

    summary = {
        "points": [],
        "failed_points": [{"name": "ads-lam0.1-tau1", "error": "Traceback ...\nRuntimeError: boom\n"}],
    }
    assert "ads-lam0.1-tau1 failed** (RuntimeError: boom)" in report.explain(summary)


def test_points_sharing_a_folder_name_are_refused_before_anything_is_written(tmp_path):
    from opdkit.config import ConfigError, load_config
    from opdkit.jobs.antidistill.config import AntidistillConfig

    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"ads-lam0\.1-tau1: λ=0\.1 τ=1\.0, λ=0\.1000001 τ=1\.0"):
        antidistill.run("tiny", {"lams": [0.1, 0.1000001], "run_dir": str(run_dir)})
    assert not run_dir.exists()
    close = antidistill.sweep_points(load_config(AntidistillConfig, "tiny", {"lams": [0.1, 0.100001]}))
    assert len({p.name for p in close}) == len(close)  # six digits apart: two folders


def test_answer_gradient_is_computed_once_before_the_processes_start(grads_run, tmp_path, monkeypatch):
    from opdkit.ads import gradfile
    from opdkit.jobs.antidistill import job, steering

    computed, launched = [], []
    real_grad, real_launch = steering.mean_completion_grad, job.launch

    def counting_grad(*args, **kwargs):
        computed.append(1)
        return real_grad(*args, **kwargs)

    def checking_launch(fn, args, n, run_path):
        launched.append((Path(run_path) / steering.ANSWER_GRADS_DIR / gradfile.GRADS_FILE).is_file())
        return real_launch(fn, args, n, run_path)

    monkeypatch.setattr(steering, "mean_completion_grad", counting_grad)
    monkeypatch.setattr(job, "launch", checking_launch)
    over = {
        **SMALL,
        "subset_size": 8,
        "eval_size": 4,
        "sft_max_steps": 1,
        "lams": [],
        "temperatures": [],
        "answer_lams": [0.1],
        "grads_run": str(grads_run),
        "run_dir": str(tmp_path / "run"),
    }
    summary = antidistill.run("tiny", over).read_summary()
    assert summary["status"] == "done" and set(summary["grad_norms"]) == {"completion", "answer"}
    assert launched == [True]  # on disk before any sweep process starts
    assert computed == [1]  # and the sweep's process loaded it instead of computing it again
