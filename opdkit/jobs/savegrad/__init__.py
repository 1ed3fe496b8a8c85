"""savegrad (notebooks/01_save_grad.ipynb): the proxy student's mean completion gradient for ADS. `job.py`
computes it, `holdout.py` makes the traces it is computed on (and tells other jobs which prompts those are,
`run_holdout`), `report.py` shows the run."""

from __future__ import annotations

from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.notebook.parameters import notebook_parameters
from opdkit.run.cli import job_main, lazy_attributes

# What the package offers from its modules, imported when first used: reading and checking the settings
# (`main` before the run, `parameters`) imports neither torch nor transformers.
LAZY = {
    "JOB": "job",
    "prepare": "job",
    "run": "job",
    "holdout_messages": "holdout",
    "run_holdout": "holdout",
}


__getattr__ = lazy_attributes(__name__, LAZY)


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `savegrad.parameters(globals())`."""
    return notebook_parameters(SaveGradConfig, namespace)


main = job_main(SaveGradConfig, "Proxy-student gradient for antidistillation (opdkit savegrad).", __name__)


__all__ = [
    "JOB",
    "holdout_messages",
    "main",
    "parameters",
    "prepare",
    "run",
    "run_holdout",
    "SaveGradConfig",
]
