"""Clip versus no clip, the job behind notebooks/03_clip_vs_noclip.ipynb (its report: `report.py`).

    python -m opdkit.cliplesson --mode tiny

The original's `noclip` mode changes two things at once: clipping off and the learning rate x5.
Every arm here is a whitebox run with the same data and seed; the two ablation arms change one
thing each, so the lesson can say how much of a blow-up is clipping and how much is learning rate.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from opdkit import memory
from opdkit.config import ConfigError, load_config, to_dict
from opdkit.jobs import whitebox
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.notebook.live import stop_after_plan
from opdkit.run import tracking
from opdkit.run.cli import run_from_cli
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir, print0

JOB = ClipLessonConfig.job


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
    extra = {"max_steps": cfg.max_steps} if cfg.max_steps else {}
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
    if cfg.eval_size >= 0:  # -1 keeps the preset's
        over["eval_size"] = cfg.eval_size
    over["sample_every"] = 1  # the spike's completions must be there to look at
    over["report_to"] = cfg.report_to  # every arm's curves and samples, through its Trainer
    return over


def memory_plan(cfg: ClipLessonConfig, arm_list: list[Arm]) -> memory.JobPlan:
    """Every arm's whitebox plan per process (the arms run one after another), against one budget. A dry
    run also runs each arm's cheap checks (its data, tokenizers and model configs): whitebox's `prepare`."""
    if cfg.dry_run:
        return memory.JobPlan(
            {
                a.name: whitebox.prepare(a.mode, {**arm_overrides(a, cfg), "dry_run": True}).plan.plan
                for a in arm_list
            }
        )
    budget = memory.budget_gb(cfg.plan_gpu_memory_gb)
    plans = {
        arm.name: whitebox.memory_plan(
            load_config(whitebox.WhiteboxConfig, arm.mode, arm_overrides(arm, cfg)), budget
        ).plan
        for arm in arm_list
    }
    return memory.JobPlan(plans)


def run_arm(arm: Arm, seed: int, cfg: ClipLessonConfig, lesson: RunDir) -> RunDir:
    """The arm's whitebox run in arms/<arm>-seed<seed>/. With resume=True a finished arm is reused and an
    unfinished one continues from its newest complete checkpoint."""
    path = lesson.path / "arms" / f"{arm.name}-seed{seed}"
    over = {**arm_overrides(arm, cfg), "seed": seed, "run_dir": str(path)}
    if cfg.resume and path.is_dir() and any(path.iterdir()):
        status = (
            RunDir.attach(path).read_summary().get("status") if (path / "summary.json").is_file() else None
        )
        if status not in (None, "training"):
            print0(f"--- arm {arm.name} (seed {seed}): reusing the finished run in {path} ({status})")
            return RunDir.attach(path)
        over["resume"] = True
    print0(
        f"--- arm {arm.name} (seed {seed}): lr {arm.learning_rate:g}, "
        f"{'clip at ' + format(arm.max_grad_norm, 'g') if arm.clipping else 'no clipping'}"
    )
    return whitebox.run(arm.mode, over)


def summarize(results: dict[str, dict[int, dict]]) -> dict:
    """One entry per arm: the first seed's figures, plus every seed's under `seeds`."""
    out = {}
    for name, by_seed in results.items():
        first = by_seed[min(by_seed)]
        out[name] = {**first, "seeds": by_seed}
    return out


@dataclass
class Prepared:
    cfg: ClipLessonConfig
    mode: str
    arms: list[Arm]
    seeds: list[int]
    existing: list[tuple[Arm, str, int]]  # clip_run and noclip_run, when given
    plan: memory.JobPlan | None = None  # every arm's memory plan per process (None when existing)


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Resolve the config, the arms and the seeds, and check given arm runs, before anything is written. Each
    arm's own prompts and tokenizers are checked by whitebox's `prepare` when it runs."""
    cfg = load_config(ClipLessonConfig, mode, overrides)
    tracking.check_report_to(cfg.report_to)
    arm_list, existing = arms(cfg), existing_arms(cfg)
    plan = None if existing else memory_plan(cfg, arm_list)
    return Prepared(cfg, mode, arm_list, parse_seeds(cfg.seeds), existing, plan)


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir | None:
    """Show every arm's memory plan and stop there under `dry_run` (None; in a notebook kernel `PlanOnly`) or
    when one does not fit (ConfigError, before any weight is loaded); else run (or collect) every arm for
    every seed, write summary.json (and plan.json); return the lesson's run dir."""
    prep = prepared or prepare(mode, overrides)
    cfg, seeds, existing = prep.cfg, prep.seeds, prep.existing
    if prep.plan is not None:
        print0(prep.plan.table())
        if cfg.dry_run:
            stop_after_plan(JOB)
            return None
        prep.plan.check()
    elif cfg.dry_run:
        print0("dry run: clip_run / noclip_run are given, so nothing would be trained and nothing is planned")
        stop_after_plan(JOB)
        return None
    lesson = RunDir.create(cfg, job=JOB, mode=prep.mode)
    if prep.plan is not None:
        atomic_write_text(lesson.path / memory.PLAN_FILE, prep.plan.to_json())
    results: dict[str, dict[int, dict]] = {}
    for arm, path, seed in existing:
        results[arm.name] = {seed: arm_stats(RunDir.attach(path), arm)}
    if not existing:
        for arm in prep.arms:
            for seed in seeds:
                results.setdefault(arm.name, {})[seed] = arm_stats(run_arm(arm, seed, cfg, lesson), arm)
    lesson.write_summary(summarize(results))
    tracker = tracking.Tracker.start(cfg.report_to, lesson, config=to_dict(cfg))
    tracker.table(
        "arms",
        [
            {"arm": name, **{k: v for k, v in entry.items() if k != "seeds"}}
            for name, entry in lesson.read_summary().items()
        ],
    )
    tracker.finish()
    return lesson


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
        c = _load_run_config(Path(path))
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


def _load_run_config(path: Path) -> dict:
    if not (path / "config.yaml").exists() or not (path / "metrics.jsonl").exists():
        raise ConfigError(f"{path} is not a whitebox run directory (no config.yaml / metrics.jsonl).")
    return RunDir.attach(path).read_config()


def main(argv: list[str] | None = None) -> None:
    from opdkit.jobs.cliplesson import report

    run_from_cli(ClipLessonConfig, "Clip vs noclip lesson (opdkit cliplesson).", run, report.figures, argv)


if __name__ == "__main__":
    main()
