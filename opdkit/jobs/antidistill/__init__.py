"""04_antidistill: antidistillation sampling against temperature sampling. `sweep.py` sets the sweep up,
`steering.py` holds the teacher, proxy and gradients, `students.py` distils and measures the students,
`points.py` runs one point, `job.py` the whole sweep; `report.py` and `lens.py` show a finished run."""

from opdkit.jobs.antidistill.job import JOB, main, prepare, run

__all__ = ["JOB", "main", "prepare", "run"]
