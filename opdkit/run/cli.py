"""The jobs' `python -m` entry points: `--mode M --set key=value ...`, `--help` listing every field.

python -m opdkit.whitebox --mode tiny --set max_steps=50 eval_size=100

Bad input (`ConfigError`: an unknown or out-of-range setting, a missing file, a global batch that does not
divide, ...) prints one line, `error: <message>`, on stderr and exits with status 2, as argparse does for a
bad flag; `--debug` shows its traceback instead. A failure while running that the kit knows (`RunFailure`: a
teacher's server that died, out of memory, an unreadable checkpoint, ...) prints one line too, after the open
progress bars are closed, and exits with status 1; the run's folder keeps its traceback (error.txt). Any other
error is a bug, and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

import yaml

from opdkit.config import (
    DEFAULT_MODE,
    ConfigError,
    RunFailure,
    RunFields,
    available_modes,
    help_text,
    load_config,
    one_line,
)
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
        epilog="settings (--set NAME=VALUE) by group, with their defaults before any preset:\n"
        + help_text(cls),
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
        "--debug",
        action="store_true",
        help="show the traceback of an error (bad input, a known failure), not its one line",
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


def close_progress_bars() -> None:
    """Close the progress bars still open, so that an error is the last line, not a stale bar drawn after
    it (on the command line, and in a notebook: `opdkit.notebook.progress.show_failure`)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(tqdm.tqdm, "_instances", ())) if tqdm else []:
        bar.close()


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
        load_config(cls, args.mode, args.overrides)  # checked before `run` imports torch: about a second
        done = run(args.mode, args.overrides)
    except (ConfigError, RunFailure) as exc:
        if args is not None and args.debug:
            raise
        close_progress_bars()
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
    if done is None:
        return None
    if done.writer:
        figures(done)
    print0(f"run directory: {done.path}")
    return done


def lazy_attributes(package: str, lazy: dict[str, str]) -> Callable[[str], object]:
    """A job package's module `__getattr__`: each name of `lazy` taken from its module (`{package}.{module}`)
    when first used, so that reading and checking the settings imports neither torch nor transformers."""

    def __getattr__(name: str):
        if name in lazy:
            return getattr(importlib.import_module(f"{package}.{lazy[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def job_main(cls: type[RunFields], description: str, package: str) -> Callable[[list[str] | None], None]:
    """A job package's `main` (`python -m opdkit.<job>`): the settings are read and checked before the job's
    `{package}.job`, and torch with it, is imported; its `{package}.report` draws the figures."""

    def main(argv: list[str] | None = None) -> None:
        def run(mode: str, overrides: dict) -> RunDir | None:
            return importlib.import_module(f"{package}.job").run(mode, overrides)

        def figures(done: RunDir) -> None:
            importlib.import_module(f"{package}.report").figures(done)

        run_from_cli(cls, description, run, figures, argv)

    return main
