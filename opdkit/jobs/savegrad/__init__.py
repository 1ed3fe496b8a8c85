"""01_save_grad: the proxy student's mean completion gradient for ADS. `job.py` computes it, `traces.py`
makes the traces it is computed on, `report.py` shows the run."""

from opdkit.jobs.savegrad.job import JOB, main, prepare, run

__all__ = ["JOB", "main", "prepare", "run"]
