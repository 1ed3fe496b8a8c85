"""opdkit.settings, every settings group, torch-free: a job's command line reads and checks its settings, and
lists them under `--help`, without importing torch or transformers, so a misspelt setting is answered in about
a second; the unknown name gets one line with the closest names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from opdkit import settings
from opdkit.config import help_text
from opdkit.jobs.whitebox.config import WhiteboxConfig

REPO = Path(__file__).resolve().parent.parent

# Runs an entry point as `python -m` does, then says which heavy modules were imported when it stopped.
WRAPPER = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
try:
    runpy.run_module(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    heavy = sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules)
    print(f"exit {stop.code}; imported: {heavy}", file=sys.stderr)
"""


def entry_point(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WRAPPER, module, *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "module", ["opdkit.whitebox", "opdkit.savegrad", "opdkit.cliplesson", "opdkit.antidistill"]
)
def test_a_misspelt_setting_is_one_line_with_the_closest_names_and_no_torch(module):
    proc = entry_point(module, "--mode", "tiny", "--set", "seeed=3")
    job = module.removeprefix("opdkit.")
    error, exit_ = proc.stderr.splitlines()  # one line, and the wrapper's
    assert error.startswith(f"error: unknown setting 'seeed' for {job}; did you mean seed"), error
    assert error.endswith("?") and exit_ == "exit 2; imported: []"


def test_help_and_a_bad_value_import_no_torch():
    proc = entry_point("opdkit.whitebox", "--help")
    assert proc.stderr.splitlines() == ["exit 0; imported: []"] and "learning_rate" in proc.stdout
    proc = entry_point("opdkit.whitebox", "--set", "beta=2")
    assert proc.stderr.splitlines()[-1] == "exit 2; imported: []"
    assert proc.stderr.startswith("error: beta=2.0 is above its maximum 1.0")


def test_help_lists_every_setting_under_its_group():
    """Each group's heading (its class name), then its settings, each once; the job's own settings under the
    job's config."""
    lines = help_text(WhiteboxConfig).splitlines()
    headings = {line.split(":")[0]: i for i, line in enumerate(lines) if not line.startswith(" ")}
    listed = [line.split()[0] for line in lines if line.startswith("  ")]
    assert sorted(listed) == sorted(f.name for f in fields(WhiteboxConfig))
    for group, name in [
        (settings.OPDTraining, "learning_rate"),
        (settings.ServedSettings, "teacher_server"),
        (WhiteboxConfig, "eval_every"),
    ]:
        at = next(i for i, line in enumerate(lines) if line.split()[:1] == [name])
        above = max(i for h, i in headings.items() if i < at)
        assert lines[above].startswith(f"{group.__name__}: "), (name, lines[above])


def test_the_settings_module_imports_no_torch():
    code = "import sys, opdkit.settings, opdkit.jobs.antidistill.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


# What a dry run must not import: transformers' Trainer, its TrainingArguments and its models' module (with
# torch's compiler and distributed tensors, seconds of imports on these machines), TRL, accelerate, peft.
TRAINING_MODULES = (
    "transformers.modeling_utils",
    "transformers.training_args",
    "transformers.trainer",
    "trl",
    "accelerate",
    "peft",
    "IPython",
)
DRY_RUN = """
import runpy, sys
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_module(sys.argv[0], run_name="__main__")
print("imported:", sorted(m for m in %r if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "module,extra",
    [
        ("opdkit.whitebox", ["subset_size=64", "eval_size=8"]),
        pytest.param("opdkit.savegrad", [], marks=pytest.mark.slow),
        pytest.param("opdkit.antidistill", [], marks=pytest.mark.slow),
        pytest.param("opdkit.cliplesson", [], marks=pytest.mark.slow),
    ],
)
def test_a_dry_run_plans_without_importing_the_trainer(module, extra, tmp_path):
    """The memory plan reads configs and tokenizers, never weights: a dry run imports torch, the tokenizers
    and datasets, and none of the training modules (issue 40: a plan in about five seconds)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            DRY_RUN % (TRAINING_MODULES,),
            module,
            "--mode",
            "tiny",
            "--set",
            "dry_run=true",
        ]
        + extra,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "CUDA_VISIBLE_DEVICES": "",
            "OPDKIT_RUNS": str(tmp_path / "runs"),
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.fullmatch(r"plan: \d+\.\d GB per process: no budget set", proc.stdout.strip().splitlines()[-1])
    assert proc.stderr.strip().splitlines()[-1] == "imported: []", proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # nothing written
