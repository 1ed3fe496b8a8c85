"""One point of antidistill's trade-off (opdkit.jobs.antidistill.points): the teacher's traces graded against
their answers, a point's complete traces reused on resume (and written again when they do not fit), and the
points spread over processes: 2 gloo processes give the summary 1 process gives, a point that fails is
reported with its traceback while the others finish, and resume runs only the unfinished ones. The
on-policy attackers: tests/test_jobs_antidistill_points_attackers.py."""

from __future__ import annotations

import json

import pytest
from helpers import SMALL_SWEEP

from opdkit.data.traces import completion
from opdkit.jobs import antidistill
from opdkit.jobs.antidistill import points
from opdkit.tasks import tiny as task

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


def _entries(summary: dict) -> list[dict]:
    """The points without their timings."""
    out = []
    for p in summary["points"]:
        runs = [{k: v for k, v in r.items() if k != "seconds"} for r in p["runs"]]
        out.append({**{k: v for k, v in p.items() if k != "seconds"}, "runs": runs})
    return out


def test_teacher_accuracy_is_checked_against_the_answer(small_run):
    traces = small_run.path / "points" / "temperature-lam0-tau1" / "seed42" / points.TRACES_FILE
    for rec in map(json.loads, traces.read_text().splitlines()):
        a, b = map(int, rec["messages"][-2]["content"].split("+"))
        assert rec["correct"] == (task.extract_answer(completion(rec)) == str(a + b))


def test_resume_reuses_a_points_complete_traces(small_run, grads_run, monkeypatch):
    """A point killed after its traces were written: resume distils its student on those traces (the teacher
    writes nothing) to the result an unbroken run had; traces that do not fit the run are written again."""
    entry = small_run.read_summary()["points"][1]
    folder = small_run.path / "points" / entry["name"]
    run_folder = folder / "seed43"
    old = json.loads((run_folder / "result.json").read_text())
    (run_folder / "result.json").unlink()
    (folder / points.POINT_FILE).unlink()

    def no_teacher(*args, **kwargs):
        raise AssertionError("resume wrote the traces again")

    monkeypatch.setattr(points, "write_traces", no_teacher)
    over = {"run_dir": str(small_run.path), "grads_run": str(grads_run), **SMALL_SWEEP, "resume": True}
    again = antidistill.run("tiny", over).read_summary()["points"][1]["runs"][1]
    assert {k: v for k, v in again.items() if k != "seconds"} == {
        k: v for k, v in old.items() if k != "seconds"
    }
    prep = antidistill.prepare("tiny", over)
    assert points.saved_traces(run_folder / points.TRACES_FILE, prep) is not None
    prep.train_messages = prep.train_messages[:-1]
    assert points.saved_traces(run_folder / points.TRACES_FILE, prep) is None


@pytest.mark.slow
def test_two_processes_give_one_process_summary_and_a_failure_waits_for_resume(
    grads_run, tmp_path, monkeypatch
):
    one = antidistill.run("tiny", {**SMALL, "grads_run": str(grads_run), "run_dir": str(tmp_path / "one")})
    expected = one.read_summary()
    assert expected["status"] == "done" and expected["num_processes"] == 1 and len(expected["points"]) == 4

    real = points.run_point

    def flaky(point, *args):
        if point.name == FAILING:
            raise RuntimeError("injected failure")
        return real(point, *args)

    monkeypatch.setattr(points, "run_point", flaky)  # forked processes inherit it
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

    monkeypatch.setattr(points, "run_point", real)
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
