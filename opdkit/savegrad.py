"""Entry point: `python -m opdkit.savegrad --mode tiny` runs the 01_save_grad job (`opdkit.jobs.savegrad`)."""

from opdkit.jobs.savegrad.job import main

if __name__ == "__main__":
    main()
