"""cliplesson (notebooks/03_clip_vs_noclip.ipynb): clipped against unclipped reverse-KL training, arms of
whitebox runs. `job.py` runs the arms, `report.py` and `figures.py` show the lesson."""

from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.jobs.cliplesson.job import JOB, arms, main, prepare, run
from opdkit.notebook.parameters import notebook_parameters


def parameters(namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell: `cliplesson.parameters(globals())`."""
    return notebook_parameters(ClipLessonConfig, namespace)


__all__ = ["JOB", "ClipLessonConfig", "arms", "main", "parameters", "prepare", "run"]
