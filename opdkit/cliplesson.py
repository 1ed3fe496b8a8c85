"""Clip versus no clip, the job behind notebooks/03_clip_vs_noclip.ipynb.

    python -m opdkit.cliplesson --mode tiny

The original's `noclip` mode changes two things at once: clipping off and the learning rate x5.
Every arm here is a 02_whitebox run with the same data and seed; the two ablation arms change one
thing each, so the lesson can say how much of a blow-up is clipping and how much is learning rate.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from opdkit import whitebox
from opdkit.config import ClipLessonConfig, ConfigError, load_config
from opdkit.runs import RunDir, print0

JOB = "03_clip_vs_noclip"


@dataclass
class Arm:
    name: str
    mode: str  # 02_whitebox preset
    overrides: dict
    learning_rate: float
    max_grad_norm: float

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
    clip = load_config(whitebox.JOB, cfg.clip_mode)
    noclip = load_config(whitebox.JOB, cfg.noclip_mode)
    extra = {"max_steps": cfg.max_steps} if cfg.max_steps else {}
    out = [
        Arm("clip", cfg.clip_mode, dict(extra), clip.learning_rate, clip.max_grad_norm),
        Arm("noclip", cfg.noclip_mode, dict(extra), noclip.learning_rate, noclip.max_grad_norm),
    ]
    if cfg.ablations:
        out += [
            Arm("clip-at-noclip-lr", cfg.clip_mode, {**extra, "learning_rate": noclip.learning_rate},
                noclip.learning_rate, clip.max_grad_norm),
            Arm("noclip-at-clip-lr", cfg.noclip_mode, {**extra, "learning_rate": clip.learning_rate},
                clip.learning_rate, noclip.max_grad_norm),
        ]  # fmt: skip
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


def run_arm(arm: Arm, seed: int, cfg: ClipLessonConfig, lesson: RunDir) -> RunDir:
    over = {**arm.overrides, "seed": seed, "run_dir": str(lesson.path / "arms" / f"{arm.name}-seed{seed}")}
    if cfg.num_processes:
        over["num_processes"] = cfg.num_processes
    if cfg.eval_size >= 0:
        over["eval_size"] = cfg.eval_size
    over["sample_every"] = 1  # the spike's completions must be there to look at
    print0(f"--- arm {arm.name} (seed {seed}): lr {arm.learning_rate:g}, "
           f"{'clip at ' + format(arm.max_grad_norm, 'g') if arm.clipping else 'no clipping'}")  # fmt: skip
    return whitebox.run(arm.mode, over)


def summarise(results: dict[str, dict[int, dict]]) -> dict:
    """One entry per arm: the first seed's figures, plus every seed's under `seeds`."""
    out = {}
    for name, by_seed in results.items():
        first = by_seed[min(by_seed)]
        out[name] = {**first, "seeds": by_seed}
    return out


def run(mode: str = "tiny", overrides: dict | None = None) -> RunDir:
    """Run (or collect) every arm for every seed; write summary.json; return the lesson's run dir."""
    cfg = load_config(JOB, mode, overrides)
    seeds = parse_seeds(cfg.seeds)
    lesson = RunDir.create(cfg, job=JOB, mode=mode)
    results: dict[str, dict[int, dict]] = {}
    if cfg.clip_run or cfg.noclip_run:
        for name, path in (("clip", cfg.clip_run), ("noclip", cfg.noclip_run)):
            if not path:
                raise ConfigError(f"give both clip_run and noclip_run (missing {name}_run).")
            existing = RunDir.attach(path)
            c = _load_run_config(Path(path))
            arm = Arm(name, c.get("mode", "?"), {}, c["learning_rate"], c["max_grad_norm"])
            results[name] = {int(c.get("seed", 0)): arm_stats(existing, arm)}
    else:
        for arm in arms(cfg):
            for seed in seeds:
                results.setdefault(arm.name, {})[seed] = arm_stats(run_arm(arm, seed, cfg, lesson), arm)
    lesson.write_summary(summarise(results))
    return lesson


def _load_run_config(path: Path) -> dict:
    import yaml

    if not (path / "config.yaml").exists() or not (path / "metrics.jsonl").exists():
        raise ConfigError(f"{path} is not a 02_whitebox run directory (no config.yaml / metrics.jsonl).")
    return yaml.safe_load((path / "config.yaml").read_text())


def largest_spike(records: list[dict]) -> int | None:
    """The step with the largest pre-clip gradient norm (finite values only)."""
    finite = [r for r in records if r.get("grad_norm") is not None and math.isfinite(r["grad_norm"])]
    return max(finite, key=lambda r: r["grad_norm"])["step"] if finite else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Clip vs noclip lesson (opdkit 03_clip_vs_noclip).")
    p.add_argument("--mode", default="tiny")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    a = p.parse_args(argv)
    import yaml

    print(run(a.mode, {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}).path)


if __name__ == "__main__":
    main()
