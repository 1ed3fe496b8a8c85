"""opdkit.settings, every settings group, torch-free: a job's command line reads and checks its settings, and
lists them under `--help`, without importing torch or transformers, so a misspelt setting is answered in about
a second; the unknown name gets one line with the closest names."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

import pytest

from opdkit import settings
from opdkit.config import help_text
from opdkit.jobs.whitebox.config import WhiteboxConfig

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
