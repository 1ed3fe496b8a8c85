"""Benchmarks against peers: OPD steps vs TRL, divergence-stage memory vs full logits, gradient saving vs ADS.

    python -m bench.run --out runs/bench                # all figures, 5 alternating runs each (~25 min)
    python -m bench.run --only P1 --reps 7              # one figure, more runs
    python -m bench.run --quick --reps 1 --out /tmp/b   # structure only: tiny sizes, seconds (the test)

Every measurement is a fresh process (see bench/common.py); sides alternate A, B, A, B, ...; each
figure is the ratio of the medians. Prints a table and writes OUT/results.json: one entry per figure
(P1..P5) with `value`, `target`, `unit`, `met`, both medians and every run behind them, the setup, and
machine facts. A rerun with --only updates those figures in an existing results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.common import Figure
from bench.registry import BENCHES, FIGURES, Bench
from bench.runner import alternate


def run(only: list[str], reps: int, quick: bool, log=print, in_process: bool = False) -> list[Figure]:
    """Run the benchmarks behind the figures in `only` (each set of runs once) and return the figures."""
    done: list[Bench] = []
    figures: list[Figure] = []
    for name in only:
        bench = BENCHES[name]
        if bench in done:
            continue
        done.append(bench)
        params = bench.default_params(quick)
        n = min(reps, bench.max_reps) if bench.max_reps else reps
        log(f"{bench.worker}: {n} alternating run(s) per side, OMP_NUM_THREADS={bench.threads}")
        samples = alternate(
            bench.worker, bench.sides, params, n, bench.threads, log=log, in_process=in_process
        )
        figures += [f for f in bench.figures(samples, params, bench.threads) if f.figure in only]
    return sorted(figures, key=lambda f: f.figure)


def table(figures: list[Figure]) -> str:
    """A Markdown table: figure, opdkit and baseline medians, ratio, target, met."""
    rows = [
        "| figure | metric | opdkit | baseline | ratio | target | met |",
        "|---|---|---:|---:|---:|---:|:-:|",
    ]
    for f in figures:
        op = ">=" if f.higher_is_better else "<="
        rows.append(
            f"| {f.figure} {f.name} | {f.metric} | {f.opdkit_median:.4g} | {f.baseline_median:.4g} | "
            f"{f.value:.2f}x | {op} {f.target}x | {'yes' if f.met else 'NO'} |"
        )
    return "\n".join(rows)


def machine() -> dict:
    import importlib.util

    import torch
    import transformers

    trl = importlib.import_module("trl") if importlib.util.find_spec("trl") else None  # not in .venv-vllm

    cpu = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": getattr(trl, "__version__", None),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


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
    p.add_argument(
        "--in-process", action="store_true", help="no fresh processes (with --quick, for the tests)"
    )
    a = p.parse_args(argv)
    names = {f.upper(): f for f in BENCHES}  # P1b, p1b and P1B alike
    only = [names.get(f.strip().upper(), f.strip()) for f in a.only.split(",") if f.strip()]
    unknown = [f for f in only if f not in BENCHES]
    if unknown or a.reps < 1:
        p.error(f"--only takes figures from {list(FIGURES)} (got {unknown}); --reps must be >= 1")
    started = time.time()
    meta = {
        **machine(),
        "reps": a.reps,
        "quick": a.quick,
        "in_process": a.in_process,
        "command": "python -m bench.run " + " ".join(argv or sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    figures = run(only, a.reps, a.quick, in_process=a.in_process)
    meta["wall_s"] = round(time.time() - started, 1)
    path = write_results(Path(a.out), figures, meta)
    print(table(figures))
    print(f"wrote {path} ({meta['wall_s']:.0f}s)")
    return figures


if __name__ == "__main__":
    main()
