"""Measurements in fresh processes, sides alternated: how every benchmark is run.

    samples = alternate("p1_opd_step", ["opdkit", "trl"], params, reps=5, threads=1)

Each measurement runs in its own Python process (`python -m bench.worker NAME SIDE PARAMS`), so peak
memory is per process and nothing one side allocated or warmed up helps the other. Sides alternate
A, B, A, B, ... so slow drift on a shared machine (other jobs, thermal) hits both alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import worker

REPO = Path(__file__).resolve().parents[1]


class WorkerFailed(RuntimeError):
    """A measurement process exited non-zero or printed no result."""


def run_worker(bench: str, side: str, params: dict, threads: int, timeout: float = 1800) -> dict:
    """One measurement in a fresh process; returns the JSON dict it printed last."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    cmd = [
        _python(bench, side),
        "-m",
        "bench.worker",
        bench,
        side,
        json.dumps({**params, "threads": threads}),
    ]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    lines = [
        ln.removeprefix(worker.RESULT_PREFIX)
        for ln in proc.stdout.splitlines()
        if ln.startswith(worker.RESULT_PREFIX)
    ]
    if proc.returncode != 0 or not lines:
        raise WorkerFailed(
            f"{bench}/{side} exited {proc.returncode} after {time.time() - started:.0f}s without a result; "
            f"its stderr ends with:\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def _python(bench: str, side: str) -> str:
    """The interpreter of the side's virtualenv (`Bench.venv_of`), else this one."""
    from bench.registry import WORKERS

    venv = WORKERS[bench].venv_of(side)
    if not venv:
        return sys.executable
    python = REPO / venv / "bin" / "python"
    if not python.exists():
        raise WorkerFailed(
            f"{bench}/{side} runs in {venv}/, which does not exist; create it with `make vllm-env`."
        )
    return str(python)


def alternate(
    bench: str,
    sides: Sequence[str],
    params: dict,
    reps: int,
    threads: int,
    log=print,
    in_process: bool = False,
) -> dict[str, list[dict]]:
    """`reps` measurements per side, in fresh processes, sides alternating A, B, A, B, ...

    `in_process=True` runs them in this process instead: quicker, for checking the machinery only
    (peak memory then includes whatever earlier measurements left allocated)."""
    samples: dict[str, list[dict]] = {s: [] for s in sides}
    for rep in range(reps):
        for side in sides:
            t0 = time.time()
            if in_process:
                samples[side].append(_measure_here(bench, side, {**params, "threads": threads}))
            else:
                samples[side].append(run_worker(bench, side, params, threads))
            log(
                f"  {bench} {side} run {rep + 1}/{reps}: {_brief(samples[side][-1])} "
                f"({time.time() - t0:.0f}s)"
            )
    return samples


def _measure_here(bench: str, side: str, params: dict) -> dict:
    """`bench.worker.measure` in this process, leaving torch's thread count as it was."""
    import torch

    threads = torch.get_num_threads()
    try:
        return worker.measure(bench, side, params)
    finally:
        torch.set_num_threads(threads)


def _brief(sample: dict) -> str:
    return ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sample.items() if k != "info"
    )
