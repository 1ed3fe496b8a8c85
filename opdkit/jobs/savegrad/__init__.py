"""savegrad (notebooks/01_save_grad.ipynb): the proxy student's mean completion gradient for ADS. `job.py`
computes it, `holdout.py` makes the traces it is computed on (and tells other jobs which prompts those are,
`run_holdout`), `report.py` shows the run."""

from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.savegrad.holdout import holdout_messages, run_holdout
from opdkit.jobs.savegrad.job import JOB, main, prepare, run
from opdkit.notebook.parameters import notebook_parameters


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `savegrad.parameters(globals())`."""
    return notebook_parameters(SaveGradConfig, namespace)


__all__ = [
    "JOB",
    "SaveGradConfig",
    "holdout_messages",
    "main",
    "parameters",
    "prepare",
    "run",
    "run_holdout",
]
