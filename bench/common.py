"""What every benchmark shares: fresh-process measurements, alternated, and the figure they make.

    samples = alternate("p1_opd_step", ["opdkit", "trl"], params, reps=5, threads=1)
    fig = ratio_figure("P1", "OPD optimizer-step throughput", samples, key="tokens_per_s", ...)

Each measurement runs in its own Python process (`python -m bench.worker NAME SIDE PARAMS`), so peak
memory is per process and nothing one side allocated or warmed up helps the other. Sides alternate
A, B, A, B, ... so slow drift on a shared machine (other jobs, thermal) hits both alike; the figure is
the ratio of the two sides' medians.

Peak RSS is measured above a baseline taken after imports and setup: `reset_peak()` writes 5 to
/proc/self/clear_refs (Linux), which resets VmHWM to the current RSS; `peak_above_baseline()` then
reads VmHWM. Where that file is missing, the peak since process start (ru_maxrss) is used instead.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
RESULT_PREFIX = "BENCH_RESULT "  # how bench.worker marks its result line


class WorkerFailed(RuntimeError):
    """A measurement process exited non-zero or printed no result."""


def _status_kib(key: str) -> int | None:
    if not _STATUS.exists():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def rss_bytes() -> int:
    """Current resident set size."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> int:
    """Make the current RSS the new peak (where the OS allows it); returns that baseline in bytes."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass
    return rss_bytes()


def peak_bytes() -> int:
    """Peak RSS since the last `reset_peak` (or process start where it cannot be reset)."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_worker(bench: str, side: str, params: dict, threads: int, timeout: float = 1800) -> dict:
    """One measurement in a fresh process; returns the JSON dict it printed last."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "bench.worker", bench, side, json.dumps({**params, "threads": threads})]
    started = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    lines = [ln.removeprefix(RESULT_PREFIX) for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise WorkerFailed(
            f"{bench}/{side} exited {proc.returncode} after {time.time() - started:.0f}s without a result; "
            f"its stderr ends with:\n{proc.stderr[-3000:]}"
        )
    return json.loads(lines[-1])


def alternate(
    bench: str, sides: Sequence[str], params: dict, reps: int, threads: int, log=print, in_process: bool = False
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
            log(f"  {bench} {side} run {rep + 1}/{reps}: {_brief(samples[side][-1])} ({time.time() - t0:.0f}s)")
    return samples


def _measure_here(bench: str, side: str, params: dict) -> dict:
    """`bench.worker.measure` in this process, leaving torch's thread count as it was."""
    import torch

    from bench import worker

    threads = torch.get_num_threads()
    try:
        return worker.measure(bench, side, params)
    finally:
        torch.set_num_threads(threads)


def _brief(sample: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sample.items() if k != "info")


def median(samples: list[dict], key: str) -> float:
    return float(statistics.median(s[key] for s in samples))


@dataclass
class Figure:
    """One row of the table and one entry of results.json."""

    figure: str
    name: str
    value: float  # opdkit median / baseline median (or baseline / opdkit when lower is better)
    target: float
    unit: str
    higher_is_better: bool
    metric: str  # what each run measured, e.g. "completion tokens/s"
    opdkit_median: float
    baseline_median: float
    baseline: str
    opdkit_runs: list[float] = field(default_factory=list)
    baseline_runs: list[float] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def ratio_figure(
    figure: str,
    name: str,
    samples: dict[str, list[dict]],
    *,
    key: str,
    metric: str,
    target: float,
    higher_is_better: bool,
    baseline: str,
    setup: dict,
    sides: tuple[str, str] = ("opdkit", "baseline"),
) -> Figure:
    """The ratio opdkit median / baseline median of `key`, with the runs behind it."""
    ours, theirs = samples[sides[0]], samples[sides[1]]
    m_ours, m_theirs = median(ours, key), median(theirs, key)
    return Figure(
        figure=figure,
        name=name,
        value=m_ours / m_theirs if m_theirs else float("nan"),
        target=target,
        unit=f"x (opdkit / baseline, {'higher' if higher_is_better else 'lower'} is better)",
        higher_is_better=higher_is_better,
        metric=metric,
        opdkit_median=m_ours,
        baseline_median=m_theirs,
        baseline=baseline,
        opdkit_runs=[s[key] for s in ours],
        baseline_runs=[s[key] for s in theirs],
        setup=setup,
    )
