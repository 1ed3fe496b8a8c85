"""The notebooks' jobs, one folder each: `job.py` computes (prepare, run, main), `report.py` turns a finished
run directory into tables, text and figures. A notebook calls a job's `run()` and its report.

Which room may import which:
- a job imports the library (`opdkit.*` outside `jobs/`) and another job's `run()` (through its package,
  e.g. `from opdkit.jobs import whitebox; whitebox.run(...)`), never another job's internals;
- the library imports no job (the `python -m opdkit.<job>` entry points are thin shims, not library);
- nothing below `if __name__ == "__main__":` but the call of `main`.
"""
