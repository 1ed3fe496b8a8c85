"""Entry point: `python -m opdkit.savegrad --mode tiny` runs the savegrad job (`opdkit.jobs.savegrad`)."""

from opdkit.jobs.savegrad import main

if __name__ == "__main__":
    main()
