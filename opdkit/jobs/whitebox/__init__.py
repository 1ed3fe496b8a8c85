"""02_whitebox: white-box on-policy distillation. `job.py` trains, `report.py` shows the run."""

from opdkit.jobs.whitebox.job import JOB, main, prepare, run

__all__ = ["JOB", "main", "prepare", "run"]
