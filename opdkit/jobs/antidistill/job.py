"""Antidistillation sampling and its trade-off, the job behind notebooks/04_antidistill.ipynb: a recipe over
`ads` (steering, sampler, teacher), `sft.student`, `opd` (the on-policy attackers) and the run lifecycle.

    python -m opdkit.antidistill --mode tiny                                  # CPU, about 3 to 5 minutes
    python -m opdkit.antidistill --mode ads-paper --set grads_run=runs/savegrad/ads    # every GPU of a node

The ADS paper's headline experiment in miniature. For every point of the sweeps (`sweep.py`)

    ADS:          λ in `lams`, at each temperature in `ads_temperatures`          method "ads"
    ADS, answer:  λ in `answer_lams`, same temperatures, answer-token gradient    method "ads-answer"
    ADS, confident: λ in `confident_lams`, the gradient without the teacher's
                  hesitations (`grad_entropy`)                                   method "ads-confident"
    temperature:  λ = 0, at each temperature in `temperatures`                    method "temperature"

the teacher writes one trace per training prompt (`ads.sampler`: z_teacher + λΔ, then temperature, then
top-p), the traces' answers are checked (teacher accuracy), a fresh student is distilled on them by
completion-only SFT, and its greedy accuracy on held-out problems is measured (student accuracy); `attackers`
adds on-policy students (`points.py`). ADS works if, at equal teacher accuracy, its students are worse. The
gradient comes from `grads_run` (a savegrad run, checked with `load_grads`), or savegrad runs in `grads/`
inside this run. Layout:

    grads/, grads_answer/, grads_confident/   the gradients (when computed here)
    points/<name>/point.json              the point's summary entry (done, or failed with its traceback)
    points/<name>/error.txt               the traceback of a point that failed (the other points go on)
    points/<name>/seed<seed>/             traces.jsonl, result.json, metrics.jsonl (SFT log), student/, sft/
                                          (checkpoints), opd/ (the ADS-scored on-policy student)
    plain/tau<τ>-seed<seed>/              the plain-scored on-policy student of that τ, shared by the points
    baseline.json, metrics.jsonl          the student before distillation; one record per point and SFT losses
    summary.json                          {"points": [{method, lam, temperature, teacher_accuracy,
                                          student_accuracy, student_accuracy_forced, student_holdout_loss,
                                          errors, runs}], "failed_points": [...], "status": "done" |
                                          "incomplete"}
    figures/                              tradeoff.png, tradeoff_holdout_loss.png, attackers.png

The points are spread over `num_processes` processes (0: one per visible GPU, 1 on a CPU), round-robin in
sweep order (`run.spread`); each holds its own teacher and proxies on its own GPU and runs its points one
after another. A point's seeds are its own, so the summary does not depend on the number of processes.
`resume=True` runs only the points not finished, reusing complete traces and each student's newest complete
checkpoint (refused when that checkpoint trained on other traces).
"""

from __future__ import annotations

import dataclasses
import json
import time

from tqdm.auto import tqdm

from opdkit import memory
from opdkit.ads.sampler import sampling_stage
from opdkit.config import to_dict
from opdkit.jobs.antidistill import findings, sweep
from opdkit.jobs.antidistill import points as pt
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.sweep import Prepared, prepared, sweep_points
from opdkit.notebook import verdicts
from opdkit.opd.stage import distill_stage
from opdkit.opd.teachers import served
from opdkit.run import spread, tracking
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir, print0
from opdkit.run.launch import default_num_processes
from opdkit.run.lifecycle import Job, fit_trace_batch, prepare_job, run_job
from opdkit.sft.student import sft_stage
from opdkit.tasks.evaluate import completion_budget


def stages(prep: Prepared, budget: float | None) -> dict[str, memory.Stage]:
    """What one process holds at the stages of every point, one after the other: the student's baseline
    evaluation beside the steering (`baseline_stage`, once), the ADS sampling of the traces
    (`ads.sampler.sampling_stage`), then, with teacher and proxies in host memory on a GPU, the
    student's SFT and evaluation (`sft.student.sft_stage`), then the on-policy attackers when asked."""
    cfg = prep.cfg
    sampling = sampling_stage(cfg, budget, gradients=1 + len(sweep.derived_gradients(cfg)))
    out = {
        "baseline evaluation": baseline_stage(cfg, sampling),
        "ADS sampling": sampling,
        "student SFT": sft_stage(cfg, budget),
    }
    if set(cfg.attackers) - {"sft"}:
        out["on-policy attackers"] = on_policy_stage(cfg, budget)
    return out


def baseline_stage(cfg: AntidistillConfig, sampling: memory.Stage) -> memory.Stage:
    """The fresh student evaluated in fp32 before any point (`points.baseline`), while the steering (teacher
    and the perturbed copies, as while sampling) is already on the device."""
    return dataclasses.replace(
        sampling,
        student=memory.ModelShape.from_config(cfg.student_model),
        student_dtype="float32",
        optimizer="none",
        sampled_rows=0,
        eval_model="student",
        eval_bf16=False,
        eval_batch_size=cfg.eval_batch_size,
        eval_completion_len=completion_budget(cfg),
    )


def on_policy_stage(cfg: AntidistillConfig, budget: float | None) -> memory.Stage:
    """The on-policy attackers: 02's trainer on one device (`opd.stage.distill_stage`), its teacher beside
    the proxy's two perturbed fp32 copies (the ADS teacher, with its stacked fp32 head), the student
    evaluated in fp32. The point's SFT student is freed before them (`points.run_once`), each attacker's
    trainer before the next, so nothing of the earlier stages is held here."""
    gpu = budget is not None
    return dataclasses.replace(
        # a served teacher saves nothing here: the sweep process holds the teacher for its traces
        distill_stage(dataclasses.replace(cfg, teacher_server=""), 1, budget),
        proxy=memory.ModelShape.from_config(cfg.proxy_model),
        teacher_dtype="bfloat16" if cfg.bf16 and gpu else "float32",
        bf16=cfg.bf16 and gpu,
        shard_teacher=False,
        ads_copies=2,
        proxy_gradients=1 + len(sweep.derived_gradients(cfg)),
        proxy_on_host=gpu,
        eval_model="student",
        eval_bf16=False,  # `points.student_accuracies` decodes the student in fp32
    )


def fit(prep: Prepared, budget: float | None) -> Prepared:
    """`trace_batch_size` 0: the largest batch of traces that fits the ADS sampling stage
    (`fit_trace_batch`)."""
    return fit_trace_batch(prep, budget, {"ADS sampling": stages(prep, budget)["ADS sampling"]})


def processes(prep: Prepared, run: RunDir) -> tuple[int, tuple]:
    """The points not finished, spread over `num_processes` processes (no more than there are points), after
    the gradients they steer by are on disk (computed once, before the processes start)."""
    cfg, points = prep.cfg, sweep_points(prep.cfg)
    todo = [p for p in points if not (cfg.resume and pt.finished(run, p))]
    n = max(1, min(default_num_processes(cfg.num_processes), len(todo)))
    prep.num_processes = n
    sweep.ensure_derived_gradients(cfg, sweep.ensure_grads(cfg, run, n), run, n)
    print0(
        f"{len(points)} points ({len(points) - len(todo)} finished before), "
        f"{len(prep.train_messages)} traces each, {n} process(es)"
    )
    if not todo and (run.path / pt.BASELINE_FILE).is_file():
        return 0, ()  # nothing left to run
    return n, (spread.assign([p.name for p in todo], n),)


def process(prep: Prepared, run: RunDir, shares: list[list[str]]) -> None:
    """What every sweep process runs: its own teacher and proxies on its own device, then its share of the
    points."""
    rank, world = spread.own_process()
    cfg, dev = prep.cfg, sweep.device()
    if rank == 0:
        run.write_env(world_size=world, device=str(dev))
    mine = [p for p in sweep_points(cfg) if p.name in set(shares[rank])]
    steering, holdout = sweep.load_steering(
        cfg, prep.proxy_tokenizer, prep.student_tokenizer, sweep.grads_path(cfg, run), dev, run
    )
    held = pt.Held(steering, holdout, dev, run)
    if cfg.teacher_server:  # the attackers' teacher states from the server, checked as 02 checks them
        dtype = next(steering.teacher.parameters()).dtype
        held.served = served.job_teacher(cfg, prep.teacher_tokenizer, dtype)[0]
        print0(f"on-policy attackers: the teacher's states from {cfg.teacher_server}, its head here")
    if rank == 0 and not (run.path / pt.BASELINE_FILE).is_file():
        before = {**pt.baseline(prep, held), "grad_norms": steering.grad_norms()}
        atomic_write_text(run.path / pt.BASELINE_FILE, json.dumps(before, indent=2))
    tag = f" (process {rank} of {world})" if world > 1 else ""
    for point in tqdm(mine, desc=f"trade-off points{tag}", position=rank if world > 1 else None):
        print0(pt.result_line(pt.point_result(point, prep, held)) + tag)


def summarize(prep: Prepared, run: RunDir, failure: str | None) -> dict:
    """The points gathered from their folders (`points.gather`), the sweep's facts; failed points said."""
    cfg = prep.cfg
    gathered = pt.gather(sweep_points(cfg), run, failure)
    gathered["points"] = [findings.with_intervals(p) for p in gathered["points"]]
    summary = {
        **gathered,
        "repeats": cfg.repeats,
        "interval": verdicts.INTERVAL_NAME,
        "findings": findings.findings(gathered),
        "grads_run": str(sweep.grads_path(cfg, run)),
        "grad_tokens": cfg.grad_tokens,
        "grad_entropy": cfg.grad_entropy if cfg.grad_tokens == "confident" else None,
        "eps": cfg.eps,
        "ads_method": cfg.ads_method,
        "top_p": cfg.trace_top_p,
        "top_k": cfg.trace_top_k,
        "grad_scale": cfg.grad_scale,
        "num_traces": len(prep.train_messages),
        "prompts_dropped": prep.dropped,
        "prompts_removed_for_overlap": prep.removed,
        "gradient_holdout": prep.gradient_holdout,  # any training prompt in it is refused in prepare
        "eval_size": len(prep.eval_messages),
        "num_processes": prep.num_processes,
        "wall_time_s": round(time.time() - prep.started, 1),
    }
    for p in summary["failed_points"]:
        print0(
            f"point {p['name']} failed (traceback in the summary and points/{p['name']}/error.txt):\n"
            f"{p['error']}"
        )
    return summary


TRACKED = ("lam", "temperature", "teacher_accuracy", "student_accuracy", "student_accuracy_forced")
TRACKED += ("student_holdout_loss",)


def track(prep: Prepared, run: RunDir, summary: dict) -> None:
    """Every point (in sweep order, as steps 1, 2, ...) and a table of them to `report_to`."""
    tracker = tracking.Tracker.start(prep.cfg.report_to, run, config=to_dict(prep.cfg))
    before = ("student_accuracy_before", "student_accuracy_before_forced", "student_holdout_loss_before")
    tracker.log({k: summary[k] for k in before if summary.get(k) is not None}, step=0)
    for i, point in enumerate(summary["points"]):
        tracker.log({k: point.get(k) for k in TRACKED}, step=i + 1)
    tracker.table(
        "points", [{"name": p["name"], **{k: p.get(k) for k in TRACKED}} for p in summary["points"]]
    )
    tracker.finish()


JOB = Job(
    "antidistill",
    AntidistillConfig,
    prepare=prepared,
    stages=stages,
    process=process,
    summarize=summarize,
    fit=fit,
    processes=processes,
    track=track,
    own_processes=True,
    keeps_going=True,
)


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Everything that can fail cheaply, nothing written (`lifecycle.prepare_job`)."""
    return prepare_job(JOB, mode, overrides)


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir | None:
    """The sweep (`lifecycle.run_job`): its folder, or None after a dry run."""
    return run_job(JOB, mode, overrides, prepared)
