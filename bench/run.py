"""Benchmarks against peers: OPD steps vs TRL, divergence-stage memory vs full logits, gradient saving vs ADS.

    python -m bench.run --out runs/bench                # all figures, 5 alternating runs each (~25 min)
    python -m bench.run --only P1 --reps 7              # one figure, more runs
    python -m bench.run --quick --reps 1 --out /tmp/b   # structure only: tiny sizes, seconds (the test)

Every measurement is a fresh process (see bench/common.py); sides alternate A, B, A, B, ...; each
figure is the ratio of the medians. Prints a table and writes OUT/results.json: one entry per figure
(P1..P4) with `value`, `target`, `unit`, `met`, both medians and every run behind them, the setup, and
machine facts. A rerun with --only updates those figures in an existing results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # `python bench/run.py` as well as `python -m bench.run`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loss_memory, opd_step, save_grad  # noqa: E402
from bench.common import Figure, alternate, ratio_figure  # noqa: E402

FIGURES = ("P1", "P2", "P3", "P4")


@dataclass
class Bench:
    """One fresh-process benchmark and the figures made from its runs."""

    worker: str
    module: object
    sides: tuple[str, str]
    threads: int
    figures: Callable[[dict, dict, int], list[Figure]]


def _p1(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {**params, "threads": threads, "tokens_per_step": _medians(samples, "tokens_per_step"),
             "step_s": _medians(samples, "step_s"), "phase_s": _phase_medians(samples)}  # fmt: skip
    return [ratio_figure("P1", "OPD optimizer-step throughput vs TRL DistillationTrainer", samples,
                         key="tokens_per_s", metric="completion tokens/s", target=1.5, higher_is_better=True,
                         baseline=opd_step.BASELINE, setup=setup, sides=("opdkit", "trl"))]  # fmt: skip


def _p2(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {**params, "threads": threads, "chunk_size": "default", "wall_s": _medians(samples, "wall_s"),
             "loss": _medians(samples, "loss")}  # fmt: skip
    return [ratio_figure("P2", "Divergence-stage peak memory vs full logits + TRL loss", samples,
                         key="peak_gb", metric="peak RSS above baseline, GB", target=0.25, higher_is_better=False,
                         baseline=loss_memory.BASELINE, setup=setup, sides=("opdkit", "trl"))]  # fmt: skip


def _p34(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {**params, "threads": threads, "params_m": samples["opdkit"][0]["params_m"],
             "completion_tokens": samples["opdkit"][0]["completion_tokens"], "wall_s": _medians(samples, "wall_s")}  # fmt: skip
    common = dict(baseline=save_grad.BASELINE, setup=setup, sides=("opdkit", "ads"))
    return [
        ratio_figure("P3", "Gradient saving peak memory vs the ADS original", samples, key="peak_rss_gb",
                     metric="peak RSS above baseline, GB", target=0.75, higher_is_better=False, **common),
        ratio_figure("P4", "Gradient saving throughput vs the ADS original", samples, key="tokens_per_s",
                     metric="completion tokens/s", target=1.3, higher_is_better=True, **common),
    ]  # fmt: skip


def _medians(samples: dict, key: str) -> dict[str, float]:
    from bench.common import median

    return {side: median(runs, key) for side, runs in samples.items()}


def _phase_medians(samples: dict) -> dict[str, dict[str, float]]:
    """Per side, the median seconds per step of each timed phase (sampler, teacher, student, rest)."""
    import statistics

    return {side: {k: statistics.median(r["phase_s"][k] for r in runs) for k in runs[0]["phase_s"]}
            for side, runs in samples.items() if runs and "phase_s" in runs[0]}  # fmt: skip


BENCHES = {
    "P1": Bench("p1_opd_step", opd_step, ("opdkit", "trl"), 1, _p1),
    "P2": Bench("p2_loss_memory", loss_memory, ("opdkit", "trl"), 2, _p2),
    "P3": Bench("p34_save_grad", save_grad, ("opdkit", "ads"), 1, _p34),
}
BENCHES["P4"] = BENCHES["P3"]  # one set of runs gives both


def run(only: list[str], reps: int, quick: bool, log=print, in_process: bool = False) -> list[Figure]:
    """Run the benchmarks behind the figures in `only` (each set of runs once) and return the figures."""
    done: list[Bench] = []
    figures: list[Figure] = []
    for name in only:
        bench = BENCHES[name]
        if bench in done:
            continue
        done.append(bench)
        params = bench.module.default_params(quick)
        log(f"{bench.worker}: {reps} alternating run(s) per side, OMP_NUM_THREADS={bench.threads}")
        samples = alternate(bench.worker, bench.sides, params, reps, bench.threads, log=log, in_process=in_process)
        figures += [f for f in bench.figures(samples, params, bench.threads) if f.figure in only]
    return sorted(figures, key=lambda f: f.figure)


def table(figures: list[Figure]) -> str:
    """A Markdown table: figure, opdkit and baseline medians, ratio, target, met."""
    rows = ["| figure | metric | opdkit | baseline | ratio | target | met |", "|---|---|---:|---:|---:|---:|:-:|"]
    for f in figures:
        op = ">=" if f.higher_is_better else "<="
        rows.append(
            f"| {f.figure} {f.name} | {f.metric} | {f.opdkit_median:.4g} | {f.baseline_median:.4g} | "
            f"{f.value:.2f}x | {op} {f.target}x | {'yes' if f.met else 'NO'} |"
        )
    return "\n".join(rows)


def machine() -> dict:
    import torch
    import transformers
    import trl

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()  # fmt: skip
    return {
        "cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "trl": trl.__version__,
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }  # fmt: skip


def write_results(out: Path, figures: list[Figure], meta: dict) -> Path:
    """Write (or update, figure by figure) OUT/results.json."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    entries = old.get("figures", {})
    for f in figures:
        entries[f.figure] = {**f.as_json(), "measured": meta}
    path.write_text(json.dumps({"figures": dict(sorted(entries.items())), "meta": meta}, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> list[Figure]:
    p = argparse.ArgumentParser(description="opdkit against TRL and the ADS scripts (see bench/README.md).")
    p.add_argument("--out", default="runs/bench", help="folder for results.json (default runs/bench)")
    p.add_argument("--reps", type=int, default=5, help="fresh-process runs per side, alternating (default 5)")
    p.add_argument("--only", default=",".join(FIGURES), help="comma-separated figures, e.g. P1,P3")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the machinery, not the claims")
    p.add_argument("--in-process", action="store_true", help="no fresh processes (with --quick, for the tests)")
    a = p.parse_args(argv)
    only = [f.strip().upper() for f in a.only.split(",") if f.strip()]
    unknown = [f for f in only if f not in BENCHES]
    if unknown or a.reps < 1:
        p.error(f"--only takes figures from {list(FIGURES)} (got {unknown}); --reps must be >= 1")
    started = time.time()
    meta = {**machine(), "reps": a.reps, "quick": a.quick, "in_process": a.in_process, "command": "python -m bench.run " + " ".join(argv or sys.argv[1:]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    figures = run(only, a.reps, a.quick, in_process=a.in_process)
    meta["wall_s"] = round(time.time() - started, 1)
    path = write_results(Path(a.out), figures, meta)
    print(table(figures))
    print(f"wrote {path} ({meta['wall_s']:.0f}s)")
    return figures


if __name__ == "__main__":
    main()
