"""whitebox (notebooks/02_whitebox.ipynb): white-box on-policy distillation. `job.py` trains (its prompts in
`inputs.py`, its accuracy in `accuracy.py`, a served teacher in `teacher.py`, repeats in `seeds.py`),
`report.py` shows the run."""

from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.jobs.whitebox.job import JOB, main, memory_plan, prepare, processes, run, stage
from opdkit.notebook.parameters import notebook_parameters


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `whitebox.parameters(globals())`."""
    return notebook_parameters(WhiteboxConfig, namespace)


__all__ = [
    "JOB",
    "WhiteboxConfig",
    "main",
    "memory_plan",
    "parameters",
    "prepare",
    "processes",
    "run",
    "stage",
]
