"""The antidistill job end to end (opdkit.jobs.antidistill, notebooks/04_antidistill.ipynb): a small trade-off
run writes every point with its runs, traces and accuracies, the baseline and the figures; resume reuses
the finished points; the notebook runs headless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SMALL_SWEEP

from opdkit.ads import gradfile
from opdkit.jobs import antidistill
from opdkit.jobs.antidistill import report
from opdkit.notebook.demo import reader_problems

REPO = Path(__file__).resolve().parent.parent


def test_small_tradeoff_run_writes_every_point(small_run):
    summary = small_run.read_summary()
    points = summary["points"]
    assert [(p["method"], p["lam"], p["temperature"]) for p in points] == [
        ("temperature", 0.0, 1.0),
        ("ads", 0.2, 1.0),
        ("ads-answer", 0.1, 1.0),
        ("temperature", 0.0, 1.5),
    ]
    for p in points:
        assert set(p) >= {"method", "lam", "temperature", "teacher_accuracy", "student_accuracy", "runs"}
        assert [r["seed"] for r in p["runs"]] == [42, 43]
        assert p["student_accuracy"] == pytest.approx(sum(r["student_accuracy"] for r in p["runs"]) / 2)
        forced = [r["student_accuracy_forced"] for r in p["runs"]]  # raw and forced, as the reference
        assert all(0 <= f <= 1 for f in forced) and p["student_accuracy_forced"] == pytest.approx(
            sum(forced) / 2
        )
        for r in p["runs"]:
            traces = (small_run.path / "points" / p["name"] / f"seed{r['seed']}" / "traces.jsonl").read_text()
            records = [json.loads(line) for line in traces.splitlines()]
            assert len(records) == 24
            assert r["teacher_accuracy"] == sum(x["correct"] for x in records) / 24
    assert (
        0 <= summary["student_accuracy_before"] <= 1 and 0 <= summary["student_accuracy_before_forced"] <= 1
    )
    table = report.summary_table_html(summary)
    assert "<th>forced</th>" in table and "(2 seeds)" not in table and "[" in table  # intervals of 2 seeds
    assert summary["repeats"] == 2 and summary["findings"]["seeds"] == 2
    assert {g["name"] for g in summary["findings"]["gaps"]} == {"ads-lam0.2-tau1", "ads-answer-lam0.1-tau1"}
    assert all(p["student_accuracy_ci"] is not None for p in points)
    # the student before distillation is the proxy: its held-out loss is the one 01_save_grad reported
    assert summary["student_holdout_loss_before"] == pytest.approx(
        gradfile.read_meta(summary["grads_run"])["loss"], rel=1e-5
    )
    assert all(r["student_holdout_loss"] > 0 for p in points for r in p["runs"])
    report.figures(small_run)  # the job computes; its report draws
    assert (small_run.path / "figures" / "tradeoff_holdout_loss.png").stat().st_size > 1000
    assert (small_run.path / "figures" / "tradeoff.png").stat().st_size > 1000
    assert (small_run.path / "grads").exists() is False  # grads_run given: nothing recomputed


def test_resume_reuses_finished_points(small_run, grads_run):
    before = small_run.read_summary()["points"]
    over = {
        "run_dir": str(small_run.path),
        "grads_run": str(grads_run),
        **SMALL_SWEEP,
        "resume": True,
    }
    again = antidistill.run("tiny", over).read_summary()["points"]
    assert [p["runs"] for p in again] == [p["runs"] for p in before]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_notebook_runs_headless(tmp_path, monkeypatch, grads_run):
    import papermill

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_dir = tmp_path / "run"
    params = {
        "run_dir": str(run_dir),
        "grads_run": str(grads_run),
        "subset_size": 64,
        "eval_size": 40,
        "sft_max_steps": 20,
        "lams": [0.0, 0.1],
        "answer_lams": [0.03],
        "temperatures": [1.4],
    }
    papermill.execute_notebook(
        str(REPO / "notebooks" / "04_antidistill.ipynb"),
        str(tmp_path / "out.ipynb"),
        parameters=params,
        kernel_name="python3",
        cwd=str(REPO / "notebooks"),
        progress_bar=False,
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [(p["method"], p["lam"], p["temperature"]) for p in summary["points"]] == [
        ("temperature", 0.0, 1.0),
        ("ads", 0.1, 1.0),
        ("ads-answer", 0.03, 1.0),
        ("temperature", 0.0, 1.4),
    ]
    for fig in ("tradeoff", "tradeoff_holdout_loss", "ads_tokens"):
        assert (run_dir / "figures" / f"{fig}.png").stat().st_size > 1000, fig
    nb = json.loads((tmp_path / "out.ipynb").read_text())
    assert reader_problems(nb) == []  # no step table, no widget, every cell within JupyterLab's 50 outputs
    run_cell = next(c["outputs"] for c in nb["cells"] if "antidistill.run(" in "".join(c["source"]))
    assert sum("held at each phase" in json.dumps(o) for o in run_cell) == 1
    assert "<table" in json.dumps(run_cell[-1]) and "Training Loss" not in json.dumps(run_cell)
    closing = next(
        c["outputs"] for c in nb["cells"][::-1] if "report.explain(summary)" in "".join(c["source"])
    )
    assert "**Finding.** At equal teacher accuracy" in json.dumps(closing) or "No ADS line" in json.dumps(
        closing
    )
