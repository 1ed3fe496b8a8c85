"""The lesson's arms: what each changes against the others, the overrides its whitebox run gets, and the
figures the summary promises, read from its run folder.

    for arm in arms(cfg): run = whitebox.run(arm.mode, {**arm_overrides(arm, cfg), "seed": 42})
    stats = arm_stats(run, arm)
    summary = lesson_summary({"clip": {42: stats, 43: ...}, "noclip": {...}})   # means, intervals, findings
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from opdkit.config import ConfigError, load_config
from opdkit.jobs import whitebox
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.notebook import verdicts
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
        over |= {
            "teacher_server": cfg.teacher_server,
            "teacher_server_dtype": cfg.teacher_server_dtype,
            "teacher_logprobs": cfg.teacher_logprobs,
        }
    over["repeats"] = 1  # the lesson repeats its arms itself
    over["sample_every"] = 1  # the spike's completions must be there to look at
    over["report_to"] = cfg.report_to  # every arm's curves and samples, through its Trainer
    return over


NUMERIC = ("max_grad_norm", "median_grad_norm", "clipped_steps", "max_loss", "final_loss", "final_accuracy")
# (arm, against, claim): each judged on the per-seed difference of final accuracy (the arms share seeds)
COMPARISONS = (
    ("clip", "noclip", "the clipped arm ends more accurate than the unclipped one (the original's pair)"),
    ("clip-at-noclip-lr", "noclip", "at noclip's learning rate, clipping alone keeps the arm more accurate"),
    ("clip", "noclip-at-clip-lr", "at clip's learning rate, clipping makes the arm more accurate"),
    ("clip", "clip-at-noclip-lr", "with clipping, the lower learning rate ends more accurate"),
    ("sgd-clip", "sgd-noclip", "with SGD at one learning rate, clipping alone makes the arm more accurate"),
)


def lesson_summary(results: dict[str, dict[int, dict]]) -> dict:
    """The lesson's summary from every arm's per-seed figures (`arm_stats`): per arm the mean of each figure
    over the seeds with its interval (`<figure>_ci`), the first seed's run folder and settings, every seed's
    figures under `seeds`; the findings (`COMPARISONS`), each a paired verdict on final accuracy."""
    out: dict[str, dict] = {}
    for name, by_seed in results.items():
        first = by_seed[min(by_seed)]
        entry = {**first, "seeds": by_seed}
        for key in NUMERIC:
            stat = verdicts.summarize([s.get(key) for s in by_seed.values()])
            entry[key], entry[f"{key}_ci"] = stat["mean"], stat["ci"]
        entry["first_nonfinite_steps"] = [s.get("first_nonfinite_step") for s in by_seed.values()]
        out[name] = entry
    findings = []
    for arm, other, claim in COMPARISONS:
        if arm in results and other in results:
            pairs = zip(results[arm].values(), results[other].values())  # seed by seed, in seed order
            diffs = [
                a["final_accuracy"] - b["final_accuracy"]
                for a, b in pairs
                if a.get("final_accuracy") is not None and b.get("final_accuracy") is not None
            ]
            findings.append({"arm": arm, "against": other, **verdicts.verdict(claim, diffs)})
    return {
        "arms": out,
        "findings": findings,
        "repeats": max((len(v) for v in results.values()), default=0),
        "interval": verdicts.INTERVAL_NAME,
    }


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
