"""Run directories: one folder per run, nothing silently overwritten.

    run = RunDir.create(cfg, job="whitebox", mode="tiny")   # ./runs/whitebox/tiny-20261130-0512-ab12
    run.log({"step": 1, "loss": 0.3})                          # metrics.jsonl
    run.write_summary({...}); run.figure("loss")               # summary.json, figures/loss.png

Layout: config.yaml (resolved), env.json (package versions, git revision, device, world size),
metrics.jsonl (one JSON object per step), summary.json (headline figures), figures/*.png, and the
job's own artifacts. Only rank 0 writes; other ranks get a RunDir whose writes do nothing.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from opdkit.config import ConfigError, MissingInput, to_dict, with_new_names
from opdkit.run.files import atomic_write_text, json_safe, read_jsonl

PACKAGE_DIR = Path(__file__).resolve().parent
RUNS_ENV = "OPDKIT_RUNS"
PACKAGES = ("opdkit", "torch", "transformers", "accelerate", "datasets", "trl", "papermill")


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def print0(*args, **kwargs) -> None:
    """print on rank 0 only."""
    if rank() == 0:
        print(*args, **kwargs, flush=True)


def runs_root() -> Path:
    """Where new run folders go: `$OPDKIT_RUNS` if set, else `runs/` under the working directory (never
    next to the installed package)."""
    return Path(os.environ.get(RUNS_ENV) or Path.cwd() / "runs")


def new_run_path(job: str, mode: str, root: Path | None = None) -> Path:
    root = runs_root() if root is None else root
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return root / job / f"{mode}-{stamp}-{secrets.token_hex(2)}"


def prepare_run_dir(path: str | Path, *, overwrite: bool = False, resume: bool = False) -> Path:
    """Create `path`; a non-empty one is an error unless `overwrite` (cleared) or `resume` (kept)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir {path} exists and is a file; give a folder path.")
    if path.is_dir() and any(path.iterdir()):
        if resume:
            return path
        if not overwrite:
            raise ConfigError(
                f"run_dir {path} is not empty; pass overwrite=True to replace it, resume=True to "
                "continue it, or leave run_dir empty for a new folder."
            )
        shutil.rmtree(path)
    elif resume:
        raise ConfigError(f"resume=True but run_dir {path} holds no earlier run to continue.")
    path.mkdir(parents=True, exist_ok=True)
    return path


def env_facts(world_size: int = 1, device: str | None = None) -> dict:
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    try:
        rev = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=PACKAGE_DIR, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        rev = None
    import torch

    if device is None:
        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "versions": versions,
        "git_revision": rev,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "cuda_devices": torch.cuda.device_count(),
        "world_size": world_size,
        "hostname": platform.node(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@dataclass
class RunDir:
    path: Path
    writer: bool = True  # False on non-zero ranks

    @classmethod
    def create(cls, cfg: Any, job: str, mode: str, root: Path | None = None) -> RunDir:
        """Resolve cfg.run_dir (a new folder when empty), prepare it, write config.yaml and env.json."""
        path = Path(cfg.run_dir) if cfg.run_dir else new_run_path(job, mode, root)
        run = cls(prepare_run_dir(path, overwrite=cfg.overwrite, resume=cfg.resume))
        cfg.run_dir = str(run.path)
        config = {"job": job, "mode": mode, **to_dict(cfg)}
        if cfg.resume and (run.path / "config.yaml").exists():
            old = with_new_names(yaml.safe_load((run.path / "config.yaml").read_text()))
            changed = {k for k in config if k not in ("resume", "overwrite") and old.get(k) != config[k]}
            if changed:
                raise ConfigError(
                    f"resume=True but these settings differ from the run in {run.path}: {sorted(changed)}; "
                    "resume with the original settings or start a new run."
                )
        atomic_write_text(run.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        return run

    @classmethod
    def attach(cls, path: str | Path) -> RunDir:
        """A handle to an existing run directory (writes only on rank 0)."""
        return cls(Path(path), writer=rank() == 0)

    def write_env(self, world_size: int = 1, device: str | None = None) -> None:
        if self.writer:
            facts = env_facts(world_size, device)
            atomic_write_text(self.path / "env.json", json.dumps(facts, indent=2))

    def log(self, record: dict, name: str = "metrics.jsonl") -> None:
        if self.writer:
            with open(self.path / name, "a") as fh:
                fh.write(json.dumps(json_safe(record)) + "\n")

    def truncate_logs(self, step: int, names: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl")) -> None:
        """Drop the records of `names` logged after `step`, the checkpoint a resumed run continues from (0:
        none), so each log has each step once."""
        if self.writer:
            for name in names:
                kept = [r for r in self.read_jsonl(name) if r.get("step", 0) <= step]
                atomic_write_text(self.path / name, "".join(json.dumps(r) + "\n" for r in kept))

    def read_jsonl(self, name: str = "metrics.jsonl") -> list[dict]:
        return read_jsonl(self.path / name)

    def read_config(self, job: str | None = None) -> dict:
        """The resolved config.yaml of this run (with `job` and `mode`), under today's setting names
        (`config.with_new_names`); `job` checks whose run it is."""
        path = self.path / "config.yaml"
        if not path.is_file():
            raise MissingInput(f"no config.yaml in {self.path}; expected a run directory opdkit wrote.")
        config = with_new_names(yaml.safe_load(path.read_text()))
        if job is not None and config.get("job") != job:
            raise ConfigError(f"{self.path} is a {config.get('job')!r} run, not a {job} run.")
        return config

    def write_summary(self, summary: dict) -> None:
        if self.writer:
            atomic_write_text(self.path / "summary.json", json.dumps(json_safe(summary), indent=2))

    def read_summary(self) -> dict:
        return json.loads((self.path / "summary.json").read_text())

    def figure(self, name: str) -> Path:
        (self.path / "figures").mkdir(exist_ok=True)
        return self.path / "figures" / f"{name}.png"
