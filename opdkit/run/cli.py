"""The jobs' `python -m` entry points: `--mode M --set key=value ...`, `--help` listing every field.

python -m opdkit.whitebox --mode tiny --set max_steps=50 eval_size=100

Bad input (`ConfigError`: an unknown or out-of-range setting, a missing file, a global batch that does not
divide, ...) prints one line, `error: <message>`, on stderr and exits with status 2, as argparse does for a
bad flag; `--debug` shows its traceback instead. Any other error is a bug or a failure of the machine, and
keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import yaml

from opdkit.config import DEFAULT_MODE, ConfigError, RunFields, available_modes, help_text, one_line
from opdkit.run.folders import RunDir, print0


def parse_cli(cls: type[RunFields], description: str, argv: list[str] | None = None) -> tuple[str, dict]:
    """`--mode M --set key=value ...` (values parsed as YAML) for the jobs' `python -m` entry points;
    `--help` lists every field with its default and help text."""
    a = arguments(cls, description, argv)
    return a.mode, a.overrides


def arguments(cls: type[RunFields], description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: `mode`, `overrides` (the `--set` pairs, values read as YAML) and `debug`."""
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
        "--set",
        nargs="*",
        action="extend",  # `--set a=1 --set b=2` keeps both
        default=[],
        metavar="KEY=VALUE",
        help="override config fields (listed below)",
    )
    p.add_argument(
        "--debug", action="store_true", help="show the traceback of a bad-input error, not just its message"
    )
    a = p.parse_args(argv)
    bad = [s for s in a.set if "=" not in s]
    if bad:
        p.error(f"--set takes KEY=VALUE pairs; got {bad}")
    a.overrides = {k: _yaml_value(k, v) for k, v in (s.split("=", 1) for s in a.set)}
    return a


def _yaml_value(key: str, text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {key}={text} is not a YAML value ({one_line(exc)}); quote it, e.g. --set '{key}=\"...\"'."
        ) from None


def run_from_cli(
    cls: type[RunFields],
    description: str,
    run: Callable[[str, dict], RunDir | None],
    figures: Callable[[RunDir], None],
    argv: list[str] | None = None,
) -> RunDir | None:
    """Parse the command line, run the job, draw its report's figures (rank 0), say where the run is; bad
    input is one line and exit status 2 (the module's docstring). A dry run (`dry_run=true`) returns None
    and prints nothing after the job's memory plan, whose last line (`plan: <total> GB of <budget> GB per
    process: fits`) scripts read."""
    args = None
    try:
        args = arguments(cls, description, argv)
        done = run(args.mode, args.overrides)
    except ConfigError as exc:
        if args is not None and args.debug:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    if done is None:
        return None
    if done.writer:
        figures(done)
    print0(f"run directory: {done.path}")
    return done
