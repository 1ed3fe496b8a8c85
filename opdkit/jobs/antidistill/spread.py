"""antidistill's points spread over processes, one per GPU: each process holds its own teacher and proxies
and runs its share of the points one after another; every point keeps its result in its own folder, and the
summary is gathered from those folders afterwards.

    shares = assign(points, 4)                                   # round-robin: point i runs in process i % 4
    launch(job.process, (cfg_dict, mode, run_path, grads_dir, shares, None), 4, run_path)
    summary = gather(points, run, failure=None)

A point's result does not depend on the process it ran in (its seeds are the point's, the student is fresh),
so N processes give the summary one process gives. A point that raises is written down with its traceback
(`points/<name>/error.txt`, and in the summary) and its process goes on with the next point (CUDA's
out-of-memory error included). A process that dies outright (killed) ends the launch: the points finished by
then are kept, the others are reported with the launcher's message, and `resume=True` runs them.
"""

from __future__ import annotations

import gc
import json
import os
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from opdkit.jobs.antidistill.points import POINTS_DIR, offload, run_point
from opdkit.jobs.antidistill.sweep import Point, Prepared
from opdkit.run.files import atomic_write_text, read_jsonl
from opdkit.run.folders import RunDir

POINT_FILE = "point.json"  # a finished (or failed) point: its summary entry
ERROR_FILE = "error.txt"
BASELINE_FILE = "baseline.json"  # the student before distillation and the gradients' norms (process 0)
# What notebook_launcher / torchrun set for torch.distributed: a sweep process trains its students alone, so
# transformers' Trainer must not see them (it would join the processes into one data-parallel run).
LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "NODE_RANK",
    "NPROC",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FORK_LAUNCHED",
)


def point_dir(run: RunDir, point: Point) -> Path:
    return run.path / POINTS_DIR / point.name


def finished(run: RunDir, point: Point) -> bool:
    f = point_dir(run, point) / POINT_FILE
    return f.is_file() and json.loads(f.read_text()).get("status") == "done"


def assign(points: list[Point], n: int) -> list[list[str]]:
    """Each process's points, by name: round-robin in sweep order, so the split depends only on the list."""
    return [[p.name for p in points[r::n]] for r in range(n)]


def own_process() -> tuple[int, int]:
    """(rank, world size) of this sweep process. With several, it keeps one GPU to itself
    (CUDA_VISIBLE_DEVICES, set before anything touches CUDA) and forgets the launcher's torch.distributed
    settings."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", rank))
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local % len(visible)] if visible else str(local)
        for key in LAUNCHER_ENV:
            os.environ.pop(key, None)
    return rank, world


def run_point_safely(point: Point, prep: Prepared, models, run: RunDir, dev: torch.device) -> dict:
    """`run_point`, its entry kept in points/<name>/point.json; an exception becomes a failed entry with its
    traceback (also in points/<name>/error.txt), and the models are put back for the next point."""
    folder = point_dir(run, point)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ERROR_FILE).unlink(missing_ok=True)
    try:
        result = {**run_point(point, prep, models, run, dev), "status": "done"}
    except Exception:
        text = traceback.format_exc()
        atomic_write_text(folder / ERROR_FILE, text)
        result = {**asdict(point), "name": point.name, "status": "failed", "error": text}
        gc.collect()
        offload(models, dev, off=False)
    atomic_write_text(folder / POINT_FILE, json.dumps(result, indent=2))
    return result


def _num(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def result_line(r: dict) -> str:
    if r["status"] != "done":
        return f"{r['name']:28s} FAILED: {r['error'].strip().splitlines()[-1]}"
    acc = r["teacher_accuracy"]
    return (
        f"{r['name']:28s} teacher {'n/a' if acc is None else f'{acc:.3f}'}  "
        f"student {r['student_accuracy']:.3f} (forced {_num(r.get('student_accuracy_forced'))})  "
        f"({r['seconds']:.0f} s)"
    )


def gather(points: list[Point], run: RunDir, failure: str | None) -> dict:
    """The points' entries in sweep order from their folders, the failed ones apart (with their tracebacks;
    a point whose process died carries `failure`, the launcher's report), and the baseline; metrics.jsonl is
    rewritten from them: one record per finished point, then each student's SFT losses (`sft_loss`)."""
    done, failed = [], []
    for p in points:
        f = point_dir(run, p) / POINT_FILE
        entry = json.loads(f.read_text()) if f.is_file() else None
        if entry is None:
            entry = {**asdict(p), "name": p.name, "status": "failed", "error": failure or "not run"}
        (done if entry["status"] == "done" else failed).append(entry)
    records = [{k: v for k, v in e.items() if k != "runs"} for e in done]
    for e in done:
        for r in e["runs"]:
            steps = read_jsonl(run.path / POINTS_DIR / e["name"] / f"seed{r['seed']}" / "metrics.jsonl")
            records.append(
                {"point": e["name"], "seed": r["seed"], "sft_loss": [s["loss"] for s in steps if "loss" in s]}
            )
    atomic_write_text(run.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    before = (
        json.loads((run.path / BASELINE_FILE).read_text()) if (run.path / BASELINE_FILE).is_file() else {}
    )
    return {
        "status": "done" if not failed else "incomplete",
        "points": done,
        "failed_points": failed,
        **before,
    }
