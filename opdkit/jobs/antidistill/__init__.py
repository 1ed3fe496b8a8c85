"""antidistill (notebooks/04_antidistill.ipynb): antidistillation sampling against temperature sampling, a
recipe over `ads`, `sft`, `opd` and the run lifecycle. `job.py` is the recipe (prepare, stages, process,
summarize), `sweep.py` sets the sweep up (points, prompts, gradients, the steering), `points.py` runs one
point and its attackers, `report.py` shows a finished run."""

from __future__ import annotations

from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.notebook.parameters import notebook_parameters
from opdkit.run.cli import job_main, lazy_attributes

# What the package offers from its modules, imported when first used: reading and checking the settings
# (`main` before the run, `parameters`) imports neither torch nor transformers.
LAZY = {
    "JOB": "job",
    "prepare": "job",
    "run": "job",
    "sweep_points": "sweep",
}


__getattr__ = lazy_attributes(__name__, LAZY)


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `antidistill.parameters(globals())`."""
    return notebook_parameters(AntidistillConfig, namespace)


main = job_main(AntidistillConfig, "Antidistillation sampling trade-off (opdkit antidistill).", __name__)


__all__ = [
    "JOB",
    "AntidistillConfig",
    "main",
    "parameters",
    "prepare",
    "run",
    "sweep_points",
]
