"""The parts every config dataclass is made of: a field with help text and range checks, the fields every
job shares, and the error a bad setting raises.

    name: int = _f(8, "help text shown by --help", min=1)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A preset, mode or parameter that cannot be used; the message says how to fix it."""


def _f(default: Any, help: str, **range_) -> Any:
    return field(default=default, metadata={"help": help, **range_})


def check_ranges(cfg: Any) -> None:
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        meta = f.metadata
        if "min" in meta and value < meta["min"]:
            raise ConfigError(f"{f.name}={value!r} is below its minimum {meta['min']} ({meta['help']}).")
        if "max" in meta and value > meta["max"]:
            raise ConfigError(f"{f.name}={value!r} is above its maximum {meta['max']} ({meta['help']}).")
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"{f.name}={value!r} is not one of {list(meta['choices'])}.")


def _float_list(name: str, value: Any) -> list[float]:
    """A sweep as a list of floats, from a YAML/papermill list or a comma-separated string."""
    if isinstance(value, str):
        value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
    if isinstance(value, (int, float)):
        value = [value]
    try:
        return [float(v) for v in value]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}={value!r} must be a list of numbers, e.g. [0.0, 0.05, 0.1] or '0,0.05,0.1'."
        ) from None


def _name_list(name: str, value: Any) -> list[str]:
    """Module names as a list of strings, from a YAML/papermill list or a comma-separated string."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(
            f"{name}={value!r} must be a list of module names, e.g. [q_proj, v_proj] or 'q_proj,v_proj'."
        )
    return [n.strip() for n in names]


@dataclass
class RunFields:
    """Fields every job shares: where it writes and how it treats an existing run directory."""

    run_dir: str = _f("", "where this run writes; empty means a new unique folder under runs/")
    overwrite: bool = _f(False, "replace the contents of a non-empty run_dir")
    resume: bool = _f(False, "continue the run in a non-empty run_dir from its last complete checkpoint")
    seed: int = _f(42, "random seed for data order, sampling and initialisation", min=0)
    num_processes: int = _f(
        0, "processes to launch (one per GPU); 0 means every visible GPU, or 1 on CPU", min=0
    )
    report_to: str = _f(
        "none",
        "experiment tracker that receives the metrics and sample tables: none, tensorboard, trackio "
        "(local-first; pip install opdkit[track]) or wandb",
        choices=("none", "tensorboard", "trackio", "wandb"),
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.overwrite and self.resume:
            raise ConfigError(
                "overwrite and resume are both set; choose one: overwrite=True starts afresh, "
                "resume=True continues."
            )
