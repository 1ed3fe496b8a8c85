"""Entry point: `python -m opdkit.whitebox --mode tiny` runs the whitebox job (`opdkit.jobs.whitebox`)."""

from opdkit.jobs.whitebox import main

if __name__ == "__main__":
    main()
