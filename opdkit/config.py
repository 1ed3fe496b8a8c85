"""Configuration: one dataclass per job, one definition per setting, presets in `params/`.

    cfg = load_config(WhiteboxConfig, mode="tiny", overrides={"learning_rate": 1e-3})
    beta: float = setting(1.0, "help text shown by --help", min=0.0, max=1.0)     # how a field is declared

Every field carries `help` text and its range, checked by `check_ranges` in `__post_init__` (the one
validator; a bad value raises `ConfigError`). Presets live in `params/<job>/<mode>.yaml` at the repository's
top level, shipped inside the wheel as `opdkit.params` (keys are field names; `extends: <mode>` inherits
another preset). Unknown modes and unknown keys stop the run before anything is written, with an error
that names the offender and lists what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import yaml

# `params/` at the top of the repository is the package `opdkit.params` (pyproject maps it), so an editable
# and a plain install both find the presets.
PARAMS_DIR = Path(str(resources.files("opdkit.params")))


class ConfigError(ValueError):
    """Bad input: a preset, mode, parameter, file or model that cannot be used; the message says how to fix
    it, in one line. Shown as that line, not a traceback: `error: <message>` on the command line (exit status
    2; `--debug` shows the traceback, `run.cli`), `ConfigError: <message>` in a notebook. Errors of the
    kit's own making (a bug) stay ordinary exceptions, with their tracebacks."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of the traceback
        return [f"{type(self).__name__}: {one_line(self)}"]


class RunFailure(Exception):
    """A failure while running that the kit knows (a teacher's server that died, a run out of memory after
    all, an unreadable checkpoint, a rollout engine that died, ...): its message says what failed and what to
    do, in one line. Shown as that line: `error: <message>` on the command line (exit status 1; `--debug`
    shows the traceback, `run.cli`) and in a notebook; a run's folder keeps the traceback in error.txt
    (`run.lifecycle`). Mixed into the kit's own exception classes, e.g. `TeacherServerError(RunFailure,
    RuntimeError)`."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of the traceback
        return [f"error: {one_line(self)}"]


class MissingInput(ConfigError, FileNotFoundError):
    """A file or folder the settings name is not there (a FileNotFoundError too)."""


def one_line(exc: BaseException) -> str:
    """An error's message on one line (a message that spans lines keeps its words)."""
    return " ".join(str(exc).split())


def setting(default: Any, help: str, **range_) -> Any:
    """A config field: its default, the help `--help` shows, and its range (`min`, `max`, `choices`)."""
    return field(default=default, metadata={"help": help, **range_})


def check_ranges(cfg: Any, only: tuple | None = None) -> None:
    """Raise ConfigError for the first field of `cfg` (or of `only`, a tuple of dataclass fields) outside its
    range; the one validator of every setting."""
    for f in only if only is not None else fields(cfg):
        value = getattr(cfg, f.name)
        meta = f.metadata
        if "min" in meta and value < meta["min"]:
            raise ConfigError(f"{f.name}={value!r} is below its minimum {meta['min']} ({meta['help']}).")
        if "max" in meta and value > meta["max"]:
            raise ConfigError(f"{f.name}={value!r} is above its maximum {meta['max']} ({meta['help']}).")
        if "choices" in meta and value not in meta["choices"]:
            raise ConfigError(f"{f.name}={value!r} is not one of {list(meta['choices'])}.")


def float_list(name: str, value: Any) -> list[float]:
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


def name_list(name: str, value: Any) -> list[str]:
    """Module names as a list of strings, from a YAML/papermill list or a comma-separated string."""
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n.strip() for n in names):
        raise ConfigError(
            f"{name}={value!r} must be a list of module names, e.g. [q_proj, v_proj] or 'q_proj,v_proj'."
        )
    return [n.strip() for n in names]


@dataclass
class RunFields:
    """Fields every job shares: where it writes and how it treats an existing run directory. A job's config
    subclasses it and the settings groups it composes (each declared once, in `opdkit.settings`) and
    names its job (`job`), which is also its presets' folder in `params/` and its runs' folder in `runs/`. A
    group that normalises its values (a comma-separated list into a list) defines `normalise(self)`, run here
    before the ranges are checked."""

    job: ClassVar[str] = ""

    run_dir: str = setting("", "where this run writes; empty means a new unique folder under runs/")
    overwrite: bool = setting(False, "replace the contents of a non-empty run_dir")
    resume: bool = setting(False, "continue the run in a non-empty run_dir from its last complete checkpoint")
    seed: int = setting(42, "random seed for data order, sampling and initialisation", min=0)
    num_processes: int = setting(
        0, "processes to launch (one per GPU); 0 means every visible GPU, or 1 on CPU", min=0
    )
    dry_run: bool = setting(
        False,
        "resolve the config, run the cheap checks (data, tokenizers, model configs), print the memory plan "
        "and stop, writing nothing",
    )
    plan_gpu_memory_gb: float = setting(
        0.0,
        "GPU memory per process the memory plan must fit, in GB (1e9 bytes); 0 means the visible GPU's, "
        "and on a CPU no budget is enforced",
        min=0.0,
    )
    report_to: str = setting(
        "none",
        "experiment tracker that receives the metrics and sample tables: none, tensorboard, trackio "
        "(local-first; pip install opdkit[track]) or wandb",
        choices=("none", "tensorboard", "trackio", "wandb"),
    )

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):  # each settings group's own `normalise`, bases first
            if "normalise" in vars(cls):
                vars(cls)["normalise"](self)
        check_ranges(self)
        if self.overwrite and self.resume:
            raise ConfigError(
                "overwrite and resume are both set; choose one: overwrite=True starts afresh, "
                "resume=True continues."
            )


@dataclass
class RepeatSettings:
    """Repeats of a run with other seeds, for the intervals its verdicts are judged on
    (`notebook.verdicts`); composed by the jobs that state a finding (02, 03, 04)."""

    repeats: int = setting(
        1,
        "runs with seeds seed, seed+1, ...: each varies what its seed varies (rollouts, data order, the "
        "student's initialisation, the teacher's traces); every number reported is their mean with its 95 % "
        "Student-t interval, and a verdict needs 2 or more (3 to settle one)",
        min=1,
    )


def repeat_seeds(cfg: Any) -> list[int]:
    """The seeds of a run's repeats: seed, seed+1, ..., `repeats` of them."""
    return [cfg.seed + k for k in range(cfg.repeats)]


DEFAULT_MODE = "tiny"
NOTEBOOK_ONLY = {"mode"}  # notebook parameters that are not config fields


def field_names(cls: type[RunFields]) -> list[str]:
    return [f.name for f in fields(cls)]


def available_modes(cls: type[RunFields], params_dir: Path = PARAMS_DIR) -> list[str]:
    return sorted(p.stem for p in (params_dir / cls.job).glob("*.yaml"))


def load_preset(cls: type[RunFields], mode: str, params_dir: Path = PARAMS_DIR, _seen: tuple = ()) -> dict:
    """The preset's keys with `extends` chains resolved (the child wins)."""
    path = params_dir / cls.job / f"{mode}.yaml"
    if not path.is_file():
        modes = available_modes(cls, params_dir)
        raise ConfigError(f"unknown mode {mode!r} for {cls.job}; valid modes: {', '.join(modes)}.")
    if mode in _seen:
        raise ConfigError(f"preset {path} extends itself through {' -> '.join(_seen + (mode,))}.")
    data = yaml.safe_load(path.read_text()) or {}
    parent = data.pop("extends", None)
    base = load_preset(cls, parent, params_dir, _seen + (mode,)) if parent else {}
    check_keys(cls, data, f"preset {path}")
    return {**base, **data}


# Settings renamed so that each name has one meaning: the old name, then its new name(s) with what each is
# for. A preset, a notebook's parameters or `--set` with an old name is refused with the new one named.
RENAMED: dict[str, tuple[tuple[str, str], ...]] = {
    "eval_steps": (
        ("eval_every", "accuracy every this many optimizer steps; not TrainingArguments' eval_steps"),
    ),
    "eval_steps_size": (("eval_every_size", "problems measured every eval_every"),),
    "save_steps": (("checkpoint_every", "checkpoints while distilling; 0: the final one only"),),
    "sft_save_steps": (("sft_checkpoint_every", "checkpoints of each SFT student; 0: none"),),
    "max_new_tokens": (
        ("rollout_max_new_tokens", "the student's rollouts"),
        ("trace_max_new_tokens", "the teacher's traces"),
    ),
    "gen_temperature": (("rollout_temperature", "the student's rollouts"),),
    "gen_top_p": (("rollout_top_p", "the student's rollouts"),),
    "gen_batch_size": (("trace_batch_size", "the teacher's traces per generation batch"),),
}


def check_renamed(cls: type[RunFields], keys: dict | set, where: str = "") -> None:
    """A key that is an old name of a setting (`RENAMED`) is refused, naming its new name(s) in `cls`."""
    valid = set(field_names(cls))
    for key in keys:
        if key in RENAMED and key not in valid:
            new = [f"{name} ({what})" for name, what in RENAMED[key] if name in valid] or [
                name for name, _ in RENAMED[key]
            ]
            raise ConfigError(
                f"parameter {key!r}{where and f' in {where}'} was renamed: use {' or '.join(new)}."
            )


def with_new_names(saved: dict) -> dict:
    """A run's saved settings (its config.yaml, written before a rename) under today's names (`RENAMED`):
    an old name's value goes to each of its new names, so a run made before a rename reads and resumes."""
    out = {k: v for k, v in saved.items() if k not in RENAMED}
    for old, renames in RENAMED.items():
        if old in saved:
            for new, _ in renames:
                out.setdefault(new, saved[old])
    return out


def check_keys(cls: type[RunFields], keys: dict | set, where: str = "") -> None:
    """Every key must name a field of `cls` (`where`: the preset they come from, if one); an old name is
    refused naming the new one (`check_renamed`), another error suggests the closest names, and leaves the
    full list to `--help`."""
    check_renamed(cls, keys, where)
    valid = field_names(cls)
    for key in keys:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=3)
            hint = (
                f"did you mean {' or '.join(close)}?"
                if close
                else f"python -m opdkit.{cls.job} --help lists them."
            )
            raise ConfigError(f"unknown setting {key!r} for {cls.job}{where and f' in {where}'}; {hint}")


def load_config(
    cls: type[RunFields],
    mode: str = DEFAULT_MODE,
    overrides: dict | None = None,
    params_dir: Path = PARAMS_DIR,
):
    """Resolve `mode`'s preset of `cls.job`, apply `overrides` (None values are ignored), validate, return an
    instance of `cls`."""
    values = load_preset(cls, mode, params_dir)
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    check_keys(cls, overrides)
    values.update(overrides)
    types = {f.name: f.type for f in fields(cls)}
    return cls(**{k: _coerce(k, v, types[k]) for k, v in values.items()})


def _coerce(name: str, value: Any, type_: str) -> Any:
    """papermill and YAML hand over ints for floats and strings for numbers; make them the field's type."""
    try:
        if type_ == "float" and not isinstance(value, bool):
            return float(value)
        if type_ == "int" and not isinstance(value, bool) and float(value) == int(float(value)):
            return int(float(value))
        if type_ == "bool" and isinstance(value, str):
            return {"true": True, "false": False}[value.lower()]
        if type_ == "str" and isinstance(value, (int, float)):
            return str(value)
    except (ValueError, KeyError):
        raise ConfigError(f"{name}={value!r} is not a valid {type_}.") from None
    return value


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def help_text(cls: type[RunFields]) -> str:
    """One line per field, name, default, help, under its settings group (the group's name and the first
    sentence of its docstring); what `papermill --help-notebook` cannot show in full."""
    lines, group = [], None
    for f in fields(cls):
        owner = next(c for c in cls.__mro__ if f.name in vars(c).get("__annotations__", {}))
        if owner is not group:
            group = owner
            about = " ".join((owner.__doc__ or "").split()).split(". ")[0].rstrip(".")
            lines.append(f"{owner.__name__}: {about}" if about else owner.__name__)
        lines.append(f"  {f.name:28s} {f.default!r:>16}  {f.metadata.get('help', '')}")
    return "\n".join(lines)
