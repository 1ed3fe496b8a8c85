"""Antidistillation sampling and its trade-off, the job behind notebooks/04_antidistill.ipynb.

    python -m opdkit.antidistill --mode tiny                                  # CPU, about 3 to 5 minutes
    python -m opdkit.antidistill --mode ads-paper --set grads_run=runs/01_save_grad/ads   # one GPU

The ADS paper's headline experiment in miniature. For every point of the sweeps

    ADS:          λ in `lams`, at each temperature in `ads_temperatures`          method "ads"
    ADS, answer:  λ in `answer_lams`, same temperatures, answer-token gradient    method "ads-answer"
    temperature:  λ = 0, at each temperature in `temperatures`                    method "temperature"

(λ = 0 is temperature sampling whatever the sweep), the teacher writes one trace per training prompt
(`opdkit.ads.ads_sample`: z_teacher + λΔ, then temperature, then top-p), the traces' answers are checked
(teacher accuracy), a fresh copy of the student is distilled on them by completion-only SFT, and its greedy
accuracy on held-out problems is measured (student accuracy). ADS works if, at equal teacher accuracy, its
students are worse.

The proxy gradient comes from `grads_run` (a 01_save_grad run, checked with `load_grads`), or, when that
is empty, 01_save_grad runs in `grads/` inside this run with the preset `grads_mode`. The answer-token
gradient is the proxy's NLL gradient on the same traces with the loss kept on their final answer only
(tiny: after ';'; else from the last \\boxed), computed here. Layout:

    grads/, grads_answer/                 the two gradients (when computed here)
    points/<name>/seed<seed>/traces.jsonl prompt, completion, answer, correct, truncated per training prompt
    points/<name>/seed<seed>/result.json  that run's accuracies, losses, error kinds (reused by resume=True)
    metrics.jsonl                         one record per point, plus the students' SFT losses (`sft_loss`)
    summary.json                          {"points": [{method, lam, temperature, teacher_accuracy,
                                          student_accuracy, student_holdout_loss, errors, runs}], ...}
    figures/tradeoff.png                  teacher accuracy (x) against distilled-student accuracy (y)
    figures/tradeoff_holdout_loss.png     teacher accuracy against the students' NLL on held-out traces

Everything runs in one process on one device (the first GPU, else the CPU); on a GPU the teacher and the
proxies wait in CPU memory while each student trains.
"""

from __future__ import annotations

import time
from dataclasses import fields
from pathlib import Path

from tqdm.auto import tqdm

from opdkit import gradfile, tracking
from opdkit.cli import run_from_cli
from opdkit.config import AntidistillationConfig, to_dict
from opdkit.jobs import savegrad
from opdkit.jobs.antidistill.points import baseline, run_point
from opdkit.jobs.antidistill.steering import Models, load_models
from opdkit.jobs.antidistill.sweep import JOB, Prepared, device, prepare, sweep_points
from opdkit.runs import RunDir, print0

GRADS_DIR = "grads"


def ensure_grads(cfg: AntidistillationConfig, run: RunDir) -> Path:
    """The gradient's run directory: grads_run, or a 01_save_grad run made now in grads/ (reused on resume)."""
    if cfg.grads_run:
        return Path(cfg.grads_run)
    path = run.path / GRADS_DIR
    if (path / gradfile.GRADS_FILE).is_file():
        print0(f"reusing the gradient in {path}")
        return path
    over = {"teacher_model": cfg.teacher_model, "proxy_model": cfg.proxy_model, "seed": cfg.seed,
            "run_dir": str(path), "overwrite": path.exists(), "num_processes": 1}  # fmt: skip
    print0(f"no grads_run: computing the proxy gradient with 01_save_grad --mode {cfg.grads_mode} in {path}")
    return savegrad.run(cfg.grads_mode, over).path


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir:
    """Prepare, create the run directory, compute or check the gradient, run every point; returns the run."""
    t0 = time.time()
    prep = prepared or prepare(mode, overrides)
    cfg, dev = prep.cfg, device()
    points = sweep_points(cfg)
    run = RunDir.create(cfg, job=JOB, mode=mode)
    run.write_env(device=str(dev))
    grads_dir = ensure_grads(cfg, run)
    models = load_models(cfg, prep, grads_dir, dev, run)
    before = baseline(prep, models, dev)
    print0(f"{len(points)} points, {len(prep.messages)} traces each; student before distillation: "
           f"{before['student_accuracy_before']:.3f}")  # fmt: skip
    tracker = tracking.Tracker.start(cfg.report_to, run, config=to_dict(cfg))
    tracker.log(before, step=0)
    results = []
    for i, point in enumerate(tqdm(points, desc="trade-off points")):
        results.append(run_point(point, prep, models, run, dev))
        run.log(results[-1])
        tracker.log({k: results[-1].get(k) for k in TRACKED}, step=i + 1)
        print0(_line(results[-1]))
    summary = summarize(cfg, results, before, grads_dir, models, prep, time.time() - t0)
    run.write_summary(summary)
    tracker.table("points", [{"name": r["name"], **{k: r.get(k) for k in TRACKED}} for r in results])
    tracker.finish()
    return run


TRACKED = ("lam", "temperature", "teacher_accuracy", "student_accuracy", "student_holdout_loss")


def _line(r: dict) -> str:
    acc = r["teacher_accuracy"]
    return (f"{r['name']:28s} teacher {'n/a' if acc is None else f'{acc:.3f}'}  "
            f"student {r['student_accuracy']:.3f}  ({r['seconds']:.0f} s)")  # fmt: skip


def summarize(cfg: AntidistillationConfig, results: list[dict], before: dict, grads_dir: Path, models: Models,
              prep: Prepared, seconds: float) -> dict:  # fmt: skip
    return {
        "status": "done",
        "points": results,
        **before,
        "grads_run": str(grads_dir),
        "grad_norms": models.grad_norms(),
        "eps": cfg.eps,
        "ads_method": cfg.ads_method,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "grad_scale": cfg.grad_scale,
        "num_traces": len(prep.messages),
        "prompts_dropped": prep.dropped,
        "eval_size": len(prep.eval_messages),
        "wall_time_s": round(seconds, 1),
    }


def load_run_config(run: RunDir | str | Path) -> tuple[AntidistillationConfig, str]:
    """The resolved config a 04_antidistill run was made with, and its mode."""
    saved = (run if isinstance(run, RunDir) else RunDir.attach(run)).read_config(JOB)
    names = {f.name for f in fields(AntidistillationConfig)}
    return AntidistillationConfig(**{k: v for k, v in saved.items() if k in names}), saved.get("mode", "?")


def main(argv: list[str] | None = None) -> None:
    from opdkit.jobs.antidistill import report

    run_from_cli(JOB, "Antidistillation sampling trade-off (opdkit 04_antidistill).", run, report.figures, argv)


if __name__ == "__main__":
    main()
