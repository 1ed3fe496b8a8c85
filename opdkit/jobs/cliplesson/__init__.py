"""03_clip_vs_noclip: clipped against unclipped reverse-KL training, arms of 02_whitebox runs. `job.py` runs
the arms, `report.py` shows the lesson."""

from opdkit.jobs.cliplesson.job import JOB, arms, main, run

__all__ = ["JOB", "arms", "main", "run"]
