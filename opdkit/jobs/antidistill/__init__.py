"""antidistill (notebooks/04_antidistill.ipynb): antidistillation sampling against temperature sampling.
`sweep.py` sets the sweep up, `steering.py` holds the teacher, proxy and gradients, `students.py` distils
and measures the SFT students, `attackers.py` the on-policy ones, `points.py` runs one point, `spread.py`
spreads the points over processes, `job.py` the whole sweep; `report.py` (with `figures.py`,
`attack_report.py` and `lens.py`) shows a finished run."""

from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.job import JOB, main, prepare, run
from opdkit.jobs.antidistill.sweep import sweep_points
from opdkit.notebook.parameters import notebook_parameters


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `antidistill.parameters(globals())`."""
    return notebook_parameters(AntidistillConfig, namespace)


__all__ = ["JOB", "AntidistillConfig", "main", "parameters", "prepare", "run", "sweep_points"]
