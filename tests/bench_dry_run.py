"""A dry run's time for every preset of every job (issue 49, item 4): best of 3 fresh processes each,
`python -m opdkit.<job> --mode <preset> --set dry_run=true` (the full presets with `plan_gpu_memory_gb=80`),
the hub offline with `test_memory_jobs`' config-only cache (the presets' hub models as config.json and the
real Qwen3 tokenizer files, the presets' data files as 7,500-row parquets), no GPU visible. A measurement, not
a test (pytest does not collect this file by itself): run it on a quiet machine,

    python -m pytest -q -s -p no:randomly -n 0 tests/bench_dry_run.py    # DRY_OUT=file.json to keep the table

`DRY_ONLY="antidistill ads-paper,whitebox full"` times those presets alone. It prints one line per preset
(best wall s, best CPU-s, the load average) and writes them to `DRY_OUT`.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from tests.test_memory_jobs import REPO, hub_cache  # noqa: F401  (the fixture)

REPEATS = 3


def presets() -> list[tuple[str, str]]:
    return [
        (job.name, p.stem) for job in sorted((REPO / "params").iterdir()) for p in sorted(job.glob("*.yaml"))
    ]


def timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def test_dry_run_times(hub_cache):  # noqa: F811
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub_cache / "hub"),
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": str(REPO),
    }
    table = {}
    only = [name.strip() for name in os.environ.get("DRY_ONLY", "").split(",") if name.strip()]
    for job, mode in presets():
        if only and f"{job} {mode}" not in only:
            continue
        extra = [] if mode.startswith("tiny") else ["plan_gpu_memory_gb=80"]
        cmd = [sys.executable, "-m", f"opdkit.{job}", "--mode", mode, "--set", "dry_run=true", *extra]
        runs = [timed(cmd, hub_cache, env) for _ in range(REPEATS)]
        table[f"{job} {mode}"] = {
            "wall_s": round(min(w for w, _ in runs), 2),
            "cpu_s": round(min(c for _, c in runs), 2),
            "load": round(os.getloadavg()[0], 2),
        }
        print(f"{job} {mode}", table[f"{job} {mode}"], flush=True)
    if os.environ.get("DRY_OUT"):
        Path(os.environ["DRY_OUT"]).write_text(json.dumps(table, indent=1))
