"""Antidistillation sampling and its trade-off, the job behind notebooks/04_antidistill.ipynb.

    python -m opdkit.antidistill --mode tiny                                  # CPU, about 3 to 5 minutes
    # every GPU of a node:
    python -m opdkit.antidistill --mode ads-paper --set grads_run=runs/01_save_grad/ads

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
    points/<name>/point.json              the point's summary entry (status done, or failed with its
                                          traceback)
    points/<name>/error.txt               the traceback of a point that failed (the other points go on)
    points/<name>/seed<seed>/traces.jsonl prompt, completion, answer, correct, truncated per training prompt
    points/<name>/seed<seed>/result.json  that run's accuracies, losses, error kinds (reused by resume=True)
    points/<name>/seed<seed>/metrics.jsonl the student's SFT log: step, loss, grad_norm, learning_rate
    points/<name>/seed<seed>/student/     the distilled student (`student_save`: LoRA adapter, or model)
    points/<name>/seed<seed>/sft/         the Trainer's checkpoints (`sft_save_steps`) and tracker logs
    baseline.json                         the student before distillation, the gradients' norms
    metrics.jsonl                         one record per point, plus the students' SFT losses (`sft_loss`)
    summary.json                          {"points": [{method, lam, temperature, teacher_accuracy,
                                          student_accuracy, student_holdout_loss, errors, runs}],
                                          "failed_points": [{name, error}], "status": "done" | "incomplete"}
    figures/tradeoff.png                  teacher accuracy (x) against distilled-student accuracy (y)
    figures/tradeoff_holdout_loss.png     teacher accuracy against the students' NLL on held-out traces

The points are spread over `num_processes` processes (0: one per visible GPU, 1 on a CPU), round-robin in
sweep order (`spread.py`); each holds its own teacher and proxies on its own GPU and runs its points one after
another, the teacher and proxies waiting in CPU memory while each student trains. A point's seeds are its own,
so the summary does not depend on the number of processes. `resume=True` runs only the points not finished.
"""

from __future__ import annotations

import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from opdkit import gradfile, tracking
from opdkit.cli import run_from_cli
from opdkit.config import AntidistillationConfig, ConfigError, to_dict
from opdkit.jobs import savegrad
from opdkit.jobs.antidistill.spread import BASELINE_FILE, assign, finished, gather, sweep_process
from opdkit.jobs.antidistill.sweep import JOB, Prepared, prepare, sweep_points
from opdkit.launch import RankFailed, default_num_processes, launch, under_external_launcher
from opdkit.runs import RunDir, print0

GRADS_DIR = "grads"


def ensure_grads(cfg: AntidistillationConfig, run: RunDir, num_processes: int = 1) -> Path:
    """The gradient's run directory: grads_run, or a 01_save_grad run made now in grads/ (reused on resume),
    in `num_processes` processes on a GPU node (its own processes: this one never touches CUDA)."""
    if cfg.grads_run:
        return Path(cfg.grads_run)
    path = run.path / GRADS_DIR
    if (path / gradfile.GRADS_FILE).is_file():
        print0(f"reusing the gradient in {path}")
        return path
    procs = num_processes if torch.cuda.device_count() > 1 else 1  # NVML's count: safe before a fork
    over = {
        "teacher_model": cfg.teacher_model,
        "proxy_model": cfg.proxy_model,
        "seed": cfg.seed,
        "run_dir": str(path),
        "overwrite": path.exists(),
        "num_processes": procs,
    }
    print0(f"no grads_run: computing the proxy gradient with 01_save_grad --mode {cfg.grads_mode} in {path}")
    return savegrad.run(cfg.grads_mode, over).path


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir:
    """Prepare, create the run directory, compute or check the gradient, run the points not yet finished in
    `num_processes` processes, gather the summary; returns the run."""
    t0 = time.time()
    prep = prepared or prepare(mode, overrides)
    cfg = prep.cfg
    if under_external_launcher():
        raise ConfigError(
            "04_antidistill spreads its points over processes itself: start it as one process with "
            "num_processes=N (0: every visible GPU), not under torchrun or accelerate launch."
        )
    points = sweep_points(cfg)
    run = RunDir.create(cfg, job=JOB, mode=mode)
    todo = [p for p in points if not (cfg.resume and finished(run, p))]
    n = max(1, min(default_num_processes(cfg.num_processes), len(todo)))
    grads_dir = ensure_grads(cfg, run, n)
    print0(
        f"{len(points)} points ({len(points) - len(todo)} finished before), "
        f"{len(prep.messages)} traces each, {n} process(es)"
    )
    failure = None
    if todo or not (run.path / BASELINE_FILE).is_file():
        args = (asdict(cfg), mode, str(run.path), str(grads_dir), assign(todo, n), prep if n == 1 else None)
        try:
            launch(sweep_process, args, n, run.path)
        except RankFailed as exc:  # a whole process died (killed, out of memory): its unfinished points fail
            failure = str(exc)
    summary = {**gather(points, run, failure), **facts(cfg, prep, grads_dir, n, time.time() - t0)}
    run.write_summary(summary)
    for p in summary["failed_points"]:
        print0(
            f"point {p['name']} failed (traceback in the summary and points/{p['name']}/error.txt):\n"
            f"{p['error']}"
        )
    track(cfg, run, summary)
    return run


TRACKED = ("lam", "temperature", "teacher_accuracy", "student_accuracy", "student_holdout_loss")


def track(cfg: AntidistillationConfig, run: RunDir, summary: dict) -> None:
    """Every point (in sweep order, as steps 1, 2, ...) and a table of them to `report_to`."""
    tracker = tracking.Tracker.start(cfg.report_to, run, config=to_dict(cfg))
    tracker.log(
        {
            k: summary[k]
            for k in ("student_accuracy_before", "student_holdout_loss_before")
            if summary.get(k) is not None
        },
        step=0,
    )
    for i, point in enumerate(summary["points"]):
        tracker.log({k: point.get(k) for k in TRACKED}, step=i + 1)
    tracker.table(
        "points", [{"name": p["name"], **{k: p.get(k) for k in TRACKED}} for p in summary["points"]]
    )
    tracker.finish()


def facts(cfg: AntidistillationConfig, prep: Prepared, grads_dir: Path, n: int, seconds: float) -> dict:
    return {
        "grads_run": str(grads_dir),
        "eps": cfg.eps,
        "ads_method": cfg.ads_method,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "grad_scale": cfg.grad_scale,
        "num_traces": len(prep.messages),
        "prompts_dropped": prep.dropped,
        "eval_size": len(prep.eval_messages),
        "num_processes": n,
        "wall_time_s": round(seconds, 1),
    }


def load_run_config(run: RunDir | str | Path) -> tuple[AntidistillationConfig, str]:
    """The resolved config a 04_antidistill run was made with, and its mode."""
    saved = (run if isinstance(run, RunDir) else RunDir.attach(run)).read_config(JOB)
    names = {f.name for f in fields(AntidistillationConfig)}
    return AntidistillationConfig(**{k: v for k, v in saved.items() if k in names}), saved.get("mode", "?")


def main(argv: list[str] | None = None) -> None:
    from opdkit.jobs.antidistill import report

    run_from_cli(
        JOB, "Antidistillation sampling trade-off (opdkit 04_antidistill).", run, report.figures, argv
    )


if __name__ == "__main__":
    main()
