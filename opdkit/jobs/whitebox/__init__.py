"""whitebox (notebooks/02_whitebox.ipynb): white-box on-policy distillation. `job.py` trains (its prompts in
`inputs.py`, its accuracy in `accuracy.py`, a served teacher in `teacher.py`, repeats in `seeds.py`),
`report.py` shows the run."""

from __future__ import annotations

from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.notebook.parameters import notebook_parameters
from opdkit.run.cli import job_main, lazy_attributes

# What the package offers from its modules, imported when first used: reading and checking the settings
# (`main` before the run, `parameters`) imports neither torch nor transformers.
LAZY = {
    "JOB": "job",
    "memory_plan": "job",
    "prepare": "job",
    "processes": "job",
    "run": "job",
    "stage": "job",
}


__getattr__ = lazy_attributes(__name__, LAZY)


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `whitebox.parameters(globals())`."""
    return notebook_parameters(WhiteboxConfig, namespace)


main = job_main(WhiteboxConfig, "White-box on-policy distillation (opdkit whitebox).", __name__)


__all__ = [
    "JOB",
    "main",
    "memory_plan",
    "parameters",
    "prepare",
    "processes",
    "run",
    "stage",
    "WhiteboxConfig",
]
