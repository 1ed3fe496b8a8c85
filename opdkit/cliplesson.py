"""Entry point: `python -m opdkit.cliplesson --mode tiny` runs the cliplesson job
(`opdkit.jobs.cliplesson`)."""

from opdkit.jobs.cliplesson import main

if __name__ == "__main__":
    main()
