"""Notebooks executed headless through papermill, as `make demo` and GPU users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pm = pytest.importorskip("papermill")  # absent from .venv-vllm, which collects every test file for -m vllm

from opdkit.notebook.demo import reader_problems  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NB = ROOT / "notebooks"


def execute(name: str, tmp_path: Path, **params) -> Path:
    out = tmp_path / f"executed-{name}"
    pm.execute_notebook(
        str(NB / name), str(out), parameters=params, kernel_name="python3", cwd=str(NB), progress_bar=False
    )
    return out


@pytest.mark.slow
def test_whitebox_notebook_runs_headless(tmp_path):
    run_dir = tmp_path / "run"
    execute("02_whitebox.ipynb", tmp_path, run_dir=str(run_dir), max_steps=12, eval_size=50, sample_every=4)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["student_accuracy_after"] is not None
    assert summary["finding"]["word"] == "within noise at 1 seed"
    for fig in ("training_curves", "accuracy", "samples"):
        assert (run_dir / "figures" / f"{fig}.png").stat().st_size > 1000, fig
    executed = tmp_path / "executed-02_whitebox.ipynb"
    assert_readable(executed, "whitebox.run(")
    run_cell = json.dumps(_cell_outputs(executed, "whitebox.run("))
    assert "loss=" in run_cell and "'loss'" not in run_cell, "a progress line, not a dict per step"
    assert "FutureWarning" not in run_cell
    closing = json.dumps(_cell_outputs(executed, "report.explain(summary)"))
    assert "**Finding.** on-policy distillation lifts" in closing
    ahead = json.dumps(_cell_outputs(executed, "ahead.explain(comparison)"))  # no arms: how to get them
    assert "has no arms sampling ahead" in ahead and "ahead_arms 1,1t,4,4t" in ahead


def assert_readable(path: Path, run_needle: str) -> None:
    """What a reader sees in JupyterLab: no cell past its 50 shown outputs, no step table, no widget output;
    the run cell's plan once, its summary table last."""
    nb = json.loads(path.read_text())
    assert reader_problems(nb) == []
    for cell in nb["cells"]:  # every figure cell shows its figure (the inline backend stays interactive)
        source = "".join(cell["source"]).strip()
        if cell["cell_type"] == "code" and source.startswith("report.") and source.endswith(";"):
            assert any("image/png" in o.get("data", {}) for o in cell["outputs"]), source
    outputs = _cell_outputs(path, run_needle)
    assert sum("held at each phase" in json.dumps(o) for o in outputs) == 1, "one plan per run cell"
    assert "<table" in json.dumps(outputs[-1]), "the summary table is the run cell's last output"
    assert "0.9966666" not in json.dumps(outputs) and "%" in json.dumps(outputs[-1])


def _cell_outputs(path: Path, needle: str) -> list[dict]:
    nb = json.loads(path.read_text())
    return next(c["outputs"] for c in nb["cells"] if needle in "".join(c["source"]))


@pytest.mark.slow
def test_whitebox_notebook_shows_a_live_figure_in_jupyterlab(tmp_path, monkeypatch):
    """OPDKIT_LIVE=1 stands for a kernel started by JupyterLab: one progress bar and one display of the
    curves, updated in place, with the accuracy measured every eval_every."""
    monkeypatch.setenv("OPDKIT_LIVE", "1")
    run_dir = tmp_path / "run"
    execute(
        "02_whitebox.ipynb",
        tmp_path,
        run_dir=str(run_dir),
        max_steps=4,
        eval_size=16,
        eval_every=2,
        eval_every_size=8,
        sample_every=2,
    )
    outputs = _cell_outputs(tmp_path / "executed-02_whitebox.ipynb", "whitebox.run(")
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1 and images[0].get("metadata") is not None
    assert "Training Loss" not in json.dumps(outputs) and "'loss'" not in json.dumps(outputs)


@pytest.mark.slow
def test_unknown_notebook_parameter_fails_before_anything_is_written(tmp_path):
    """papermill alone only warns about `-p bogus 1`; the notebook must stop with a clear error."""
    run_dir = tmp_path / "run"
    out = tmp_path / "out.ipynb"
    cmd = [
        sys.executable,
        "-m",
        "papermill",
        str(NB / "02_whitebox.ipynb"),
        str(out),
        "-p",
        "bogus",
        "1",
        "-p",
        "run_dir",
        str(run_dir),
        "-k",
        "python3",
        "--cwd",
        str(NB),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    text = out.read_text()
    assert "bogus" in text and "ConfigError" in text
    assert not run_dir.exists()


@pytest.mark.slow
def test_dry_run_stops_the_notebook_at_the_run_cell_with_the_plan(tmp_path):
    """`-p dry_run True`: the plan is shown, then one line says why the notebook stopped (not an
    AttributeError from a report cell); nothing is written."""
    run_dir = tmp_path / "run"
    out = tmp_path / "out.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as err:
        pm.execute_notebook(
            str(NB / "02_whitebox.ipynb"),
            str(out),
            parameters={"dry_run": True, "run_dir": str(run_dir)},
            kernel_name="python3",
            cwd=str(NB),
            progress_bar=False,
        )
    assert err.value.ename == "PlanOnly" and "dry run" in err.value.evalue
    assert err.value.traceback == [f"PlanOnly: {err.value.evalue}"], "one line, not a traceback"
    run_cell = json.dumps(_cell_outputs(out, "whitebox.run("))
    assert "held at each phase" in run_cell and "plan: " in run_cell
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "parameters,message",
    [
        ({"bogus": 1}, "unknown setting 'bogus' for whitebox in the notebook's parameters cell;"),
        ({"global_batch_size": 6, "per_device_train_batch_size": 4}, "global_batch_size=6 prompts"),
    ],
)
def test_bad_input_stops_the_notebook_with_one_line(tmp_path, parameters, message):
    """Bad input (a ConfigError) shows as one line in the notebook, as a dry run's stop does, not as a
    traceback; a global batch that does not divide is caught before the prompts are measured."""
    run_dir = tmp_path / "run"
    with pytest.raises(pm.PapermillExecutionError) as err:
        pm.execute_notebook(
            str(NB / "02_whitebox.ipynb"),
            str(tmp_path / "out.ipynb"),
            parameters={**parameters, "run_dir": str(run_dir)},
            kernel_name="python3",
            cwd=str(NB),
            progress_bar=False,
        )
    assert err.value.ename == "ConfigError" and message in err.value.evalue, err.value.evalue
    assert err.value.traceback == [f"ConfigError: {err.value.evalue}"], "one line, not a traceback"
    assert "measuring prompts" not in (tmp_path / "out.ipynb").read_text()
    assert not run_dir.exists()


@pytest.mark.slow
def test_clip_lesson_notebook_runs_headless(tmp_path):
    run_dir = tmp_path / "lesson"
    execute("03_clip_vs_noclip.ipynb", tmp_path, run_dir=str(run_dir), arm_max_steps=6, arm_eval_size=20)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["arms"]) == {
        "clip",
        "noclip",
        "clip-at-noclip-lr",
        "noclip-at-clip-lr",
        "sgd-clip",
        "sgd-noclip",
    }
    for fig in ("loss_and_grad_norm", "final_accuracy", "spike_samples"):
        assert (run_dir / "figures" / f"{fig}.png").stat().st_size > 1000, fig
    executed = tmp_path / "executed-03_clip_vs_noclip.ipynb"
    assert_readable(executed, "cliplesson.run(")
    closing = json.dumps(_cell_outputs(executed, "report.explain(summary)"))
    assert "**Finding.** the clipped arm ends more accurate" in closing


@pytest.mark.slow
def test_run_all_twice_in_one_kernel_reads_the_parameters_cell(tmp_path):
    """As in JupyterLab: Run All, edit the parameters cell, Run All again in the same kernel. The first
    run's variables and a scratch variable are no parameters; an edited value takes effect and a
    deleted line falls back to the preset."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NB / "01_save_grad.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    nb.cells.append(nbformat.v4.new_code_cell("scratch = 1  # a user's own variable"))
    client = NotebookClient(nb, kernel_name="python3", resources={"metadata": {"path": str(NB)}}, timeout=600)
    first, second = tmp_path / "first", tmp_path / "second"
    with client.setup_kernel():
        params.source = (
            f'mode: str = "tiny"\nrun_dir: str = "{first}"\nsubset_size: int = 8\nbatch_size: int = 2'
        )
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
        params.source = f'mode: str = "tiny"\nrun_dir: str = "{second}"\nsubset_size: int = 6'
        for i, cell in enumerate(nb.cells):
            client.execute_cell(cell, i)
    cfg1 = yaml.safe_load((first / "config.yaml").read_text())
    cfg2 = yaml.safe_load((second / "config.yaml").read_text())
    assert (cfg1["subset_size"], cfg1["batch_size"]) == (8, 2)
    assert (cfg2["subset_size"], cfg2["batch_size"]) == (6, 8)  # 8: the tiny preset's
