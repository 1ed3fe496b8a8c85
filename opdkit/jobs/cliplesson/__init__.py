"""cliplesson (notebooks/03_clip_vs_noclip.ipynb): clipped against unclipped reverse-KL training, arms of
whitebox runs. `job.py` runs the arms, `report.py` and `figures.py` show the lesson."""

from __future__ import annotations

# `arms` (torch-free) binds here the function, not its module's name (arms.py).
from opdkit.jobs.cliplesson.arms import arms
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.notebook.parameters import notebook_parameters
from opdkit.run.cli import job_main, lazy_attributes

# What the package offers from its modules, imported when first used: reading and checking the settings
# (`main` before the run, `parameters`) imports neither torch nor transformers.
LAZY = {
    "JOB": "job",
    "prepare": "job",
    "run": "job",
}


__getattr__ = lazy_attributes(__name__, LAZY)


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `cliplesson.parameters(globals())`."""
    return notebook_parameters(ClipLessonConfig, namespace)


main = job_main(ClipLessonConfig, "Clip vs noclip lesson (opdkit cliplesson).", __name__)


__all__ = [
    "JOB",
    "arms",
    "ClipLessonConfig",
    "main",
    "parameters",
    "prepare",
    "run",
]
