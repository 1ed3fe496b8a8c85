"""Entry point: `python -m opdkit.antidistill --mode tiny` runs the antidistill job
(`opdkit.jobs.antidistill`)."""

from opdkit.jobs.antidistill import main

if __name__ == "__main__":
    main()
