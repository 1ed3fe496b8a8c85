"""Send a job's numbers to an experiment tracker: `report_to` = none, tensorboard, trackio or wandb.

    tracker = Tracker.start(cfg.report_to, run, config=to_dict(cfg))   # rank 0 tracks; elsewhere a no-op
    tracker.log({"teacher_accuracy": 0.93}, step=0)
    tracker.table("traces", [{"prompt": "1+2", "completion": "3", "correct": True}])
    tracker.finish()

whitebox (and so every arm of 03) reports through transformers' own integrations (`report_to` of its
TrainingArguments; its sample tables: `opd.callbacks.report_samples`); 01 and 04 and 03's lesson summary go
through here. A table is a native table in trackio and wandb, and a markdown table (TEXT tab) in tensorboard.
tensorboard writes under `<run_dir>/tensorboard`; trackio keeps its local store (`$TRACKIO_DIR`, else
under `$HF_HOME`), shown by `trackio show`; wandb follows its own login and `WANDB_MODE`. The tracker's
package must be installed (trackio: `pip install "opdkit[track]"`); `check_report_to` says so before anything
is written.
"""

from __future__ import annotations

import importlib.util
import numbers
from typing import Any

from opdkit.config import ConfigError

TRACKERS = ("none", "tensorboard", "trackio", "wandb")
PROJECT = "opdkit"
PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}
INSTALL = {
    "tensorboard": "pip install tensorboard",
    "trackio": 'pip install "opdkit[track]"',
    "wandb": "pip install wandb",
}


def check_report_to(report_to: str) -> None:
    """A known tracker whose package is installed (before any run directory is made)."""
    if report_to not in TRACKERS:
        raise ConfigError(f"report_to={report_to!r} is not one of {list(TRACKERS)}.")
    if report_to != "none" and importlib.util.find_spec(PACKAGES[report_to]) is None:
        raise ConfigError(
            f"report_to={report_to!r} but {PACKAGES[report_to]} is not installed; {INSTALL[report_to]}."
        )


class Tracker:
    """One run's connection to a tracker; every method is a no-op for `none` and off rank 0."""

    def __init__(self, backend: str = "none", handle: Any = None):
        self.backend, self.handle = backend, handle

    @classmethod
    def start(cls, report_to: str, run, config: dict | None = None, project: str = PROJECT) -> Tracker:
        check_report_to(report_to)
        if report_to == "none" or not run.writer:
            return cls()
        name = f"{run.path.parent.name}/{run.path.name}"
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return cls(report_to, SummaryWriter(log_dir=str(run.path / "tensorboard")))
        if report_to == "trackio":
            import trackio

            trackio.init(project=project, name=name, config=config)
            return cls(report_to, trackio)
        import wandb

        return cls(report_to, wandb.init(project=project, name=name, config=config, dir=str(run.path)))

    @classmethod
    def active(cls, report_to: str, run) -> Tracker:
        """The tracker run that transformers' integration has started (02's Trainer), to add tables to it."""
        if report_to == "none" or not run.writer:
            return cls()
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return cls(report_to, SummaryWriter(log_dir=str(run.path / "tensorboard")))
        if report_to == "trackio":
            import trackio

            return cls(report_to, trackio)
        import wandb

        return cls(report_to, wandb.run) if wandb.run is not None else cls()

    def log(self, metrics: dict, step: int | None = None) -> None:
        """Numbers only (None and text are left out)."""
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}
        if not numeric or self.backend == "none":
            return
        if self.backend == "tensorboard":
            for key, value in numeric.items():
                self.handle.add_scalar(key, value, step)
        else:
            self.handle.log(numeric, step=step)

    def table(self, name: str, rows: list[dict], step: int | None = None) -> None:
        """Rows of equal keys as one table; values that are not numbers or bools become text."""
        if not rows or self.backend == "none":
            return
        columns = list(rows[0])
        data = [[_cell(r.get(c)) for c in columns] for r in rows]
        if self.backend == "tensorboard":
            self.handle.add_text(name, markdown_table(columns, data), step)
        elif self.backend == "trackio":
            self.handle.log({name: self.handle.Table(columns=columns, data=data)}, step=step)
        else:
            import wandb

            self.handle.log({name: wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self) -> None:
        if self.backend == "tensorboard":
            self.handle.close()
        elif self.backend != "none":
            self.handle.finish()
        self.backend = "none"


def _cell(value: Any) -> Any:
    return value if isinstance(value, (bool, numbers.Real)) or value is None else str(value)


def markdown_table(columns: list[str], data: list[list]) -> str:
    esc = lambda v: str(v).replace("|", "\\|").replace("\n", "⏎")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(esc(v) for v in row) + " |" for row in data])
