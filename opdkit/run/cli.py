"""The jobs' `python -m` entry points: `--mode M --set key=value ...`, `--help` listing every field.

python -m opdkit.whitebox --mode tiny --set max_steps=50 eval_size=100
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import yaml

from opdkit.config import DEFAULT_MODE, RunFields, available_modes, help_text
from opdkit.run.folders import RunDir, print0


def parse_cli(cls: type[RunFields], description: str, argv: list[str] | None = None) -> tuple[str, dict]:
    """`--mode M --set key=value ...` (values parsed as YAML) for the jobs' `python -m` entry points;
    `--help` lists every field with its default and help text."""
    p = argparse.ArgumentParser(
        prog=f"python -m opdkit.{cls.job}",
        description=description,
        epilog="fields (--set NAME=VALUE), with their defaults before any preset:\n" + help_text(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mode",
        default=DEFAULT_MODE,
        help=f"preset in params/{cls.job}/: {', '.join(available_modes(cls))}",
    )
    p.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields (listed below)"
    )
    a = p.parse_args(argv)
    bad = [s for s in a.set if "=" not in s]
    if bad:
        p.error(f"--set takes KEY=VALUE pairs; got {bad}")
    return a.mode, {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}


def run_from_cli(
    cls: type[RunFields],
    description: str,
    run: Callable[[str, dict], RunDir | None],
    figures: Callable[[RunDir], None],
    argv: list[str] | None = None,
) -> RunDir | None:
    """Parse the command line, run the job, draw its report's figures (rank 0), say where the run is. A
    dry run (`dry_run=true`) returns None and prints nothing after the job's memory plan, whose last line
    (`plan: <total> GB of <budget> GB per process: fits`) scripts read."""
    mode, overrides = parse_cli(cls, description, argv)
    done = run(mode, overrides)
    if done is None:
        return None
    if done.writer:
        figures(done)
    print0(f"run directory: {done.path}")
    return done
