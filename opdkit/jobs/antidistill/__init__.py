"""antidistill (notebooks/04_antidistill.ipynb): antidistillation sampling against temperature sampling, a
recipe over `ads`, `sft`, `opd` and the run lifecycle. `job.py` is the recipe (prepare, stages, process,
summarize), `sweep.py` sets the sweep up (points, prompts, gradients, the steering), `points.py` runs one
point and its attackers, `report.py` shows a finished run."""

from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.job import JOB, main, prepare, run
from opdkit.jobs.antidistill.sweep import sweep_points
from opdkit.notebook.parameters import notebook_parameters


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `antidistill.parameters(globals())`."""
    return notebook_parameters(AntidistillConfig, namespace)


__all__ = ["JOB", "AntidistillConfig", "main", "parameters", "prepare", "run", "sweep_points"]
