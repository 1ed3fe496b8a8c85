"""The lesson's arms: what each changes against the others, the overrides its whitebox run gets, and the
figures the summary promises, read from its run folder.

    for arm in arms(cfg): run = whitebox.run(arm.mode, {**arm_overrides(arm, cfg), "seed": 42})
    stats = arm_stats(run, arm)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from opdkit.config import ConfigError, load_config
from opdkit.jobs import whitebox
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.run.folders import RunDir


@dataclass
class Arm:
    name: str
    mode: str  # whitebox preset
    overrides: dict
    learning_rate: float
    max_grad_norm: float
    optimizer: str = "adamw"

    @property
    def clipping(self) -> bool:
        return 0 < self.max_grad_norm < 1e8


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in str(text).replace(" ", "").split(",") if s]
    except ValueError:
        raise ConfigError(f"seeds={text!r} must be comma-separated integers, e.g. '1,2,3'.") from None
    if not seeds:
        raise ConfigError("seeds is empty; give at least one seed, e.g. '42'.")
    return seeds


def arms(cfg: ClipLessonConfig) -> list[Arm]:
    """clip and noclip as the presets define them; the ablations swap one setting each."""
    clip = load_config(whitebox.WhiteboxConfig, cfg.clip_mode)
    noclip = load_config(whitebox.WhiteboxConfig, cfg.noclip_mode)
    extra = {"max_steps": cfg.arm_max_steps} if cfg.arm_max_steps else {}
    out = [
        Arm("clip", cfg.clip_mode, dict(extra), clip.learning_rate, clip.max_grad_norm),
        Arm("noclip", cfg.noclip_mode, dict(extra), noclip.learning_rate, noclip.max_grad_norm),
    ]
    if cfg.ablations:
        out += [
            Arm(
                "clip-at-noclip-lr",
                cfg.clip_mode,
                {**extra, "learning_rate": noclip.learning_rate},
                noclip.learning_rate,
                clip.max_grad_norm,
            ),
            Arm(
                "noclip-at-clip-lr",
                cfg.noclip_mode,
                {**extra, "learning_rate": clip.learning_rate},
                clip.learning_rate,
                noclip.max_grad_norm,
            ),
        ]
    if cfg.sgd_arms:
        sgd = {
            **extra,
            "optim": "sgd",
            "optim_args": f"momentum={cfg.sgd_momentum}",
            "learning_rate": cfg.sgd_lr,
        }
        out += [
            Arm(
                "sgd-clip",
                cfg.clip_mode,
                {**sgd, "max_grad_norm": clip.max_grad_norm},
                cfg.sgd_lr,
                clip.max_grad_norm,
                "sgd",
            ),
            Arm("sgd-noclip", cfg.clip_mode, {**sgd, "max_grad_norm": 0.0}, cfg.sgd_lr, 0.0, "sgd"),
        ]
    return out


def arm_stats(run: RunDir, arm: Arm) -> dict:
    """The figures the summary promises, from one arm's metrics.jsonl and summary.json."""
    records = run.read_jsonl()
    norms = [r["grad_norm"] for r in records if r.get("grad_norm") is not None]
    loss = [r["loss"] for r in records if r.get("loss") is not None]
    s = run.read_summary()
    return {
        "learning_rate": arm.learning_rate,
        "max_grad_norm_setting": arm.max_grad_norm,
        "clipping": arm.clipping,
        "optimizer": arm.optimizer,
        "max_grad_norm": max(norms) if norms else None,
        "median_grad_norm": statistics.median(norms) if norms else None,
        "clipped_steps": sum(bool(r.get("clipped")) for r in records),
        "max_loss": max(loss) if loss else None,
        "final_loss": loss[-1] if loss else None,
        "final_accuracy": s.get("student_accuracy_after"),
        "accuracy_before": s.get("student_accuracy_before"),
        "first_nonfinite_step": s.get("first_nonfinite_step"),
        "steps": s.get("steps"),
        "run_dir": str(run.path),
    }


def arm_overrides(arm: Arm, cfg: ClipLessonConfig) -> dict:
    """What the lesson sets in an arm's whitebox config, beside the arm's own overrides."""
    over = {**arm.overrides, "plan_gpu_memory_gb": cfg.plan_gpu_memory_gb}
    if cfg.num_processes:
        over["num_processes"] = cfg.num_processes
    if cfg.arm_eval_size >= 0:  # -1 keeps the preset's
        over["eval_size"] = cfg.arm_eval_size
    if cfg.teacher_server:
        over |= {"teacher_server": cfg.teacher_server, "teacher_server_dtype": cfg.teacher_server_dtype}
    over["sample_every"] = 1  # the spike's completions must be there to look at
    over["report_to"] = cfg.report_to  # every arm's curves and samples, through its Trainer
    return over


def existing_arms(cfg: ClipLessonConfig) -> list[tuple[Arm, str, int]]:
    """(arm, run directory, seed) for clip_run and noclip_run; empty when neither is given."""
    if not (cfg.clip_run or cfg.noclip_run):
        return []
    pairs = (("clip", cfg.clip_run), ("noclip", cfg.noclip_run))
    for name, path in pairs:
        if not path:
            raise ConfigError(f"give both clip_run and noclip_run (missing {name}_run).")
    out = []
    for name, path in pairs:
        c = load_run_config(Path(path))
        out.append(
            (
                Arm(
                    name,
                    c.get("mode", "?"),
                    {},
                    c["learning_rate"],
                    c["max_grad_norm"],
                    "sgd" if c.get("optim") == "sgd" else "adamw",
                ),
                path,
                int(c.get("seed", 0)),
            )
        )
    return out


def load_run_config(path: Path) -> dict:
    if not (path / "config.yaml").exists() or not (path / "metrics.jsonl").exists():
        raise ConfigError(f"{path} is not a whitebox run directory (no config.yaml / metrics.jsonl).")
    return RunDir.attach(path).read_config()
