"""whitebox (tiny, its default 300 steps): seconds of the training cell headless (papermill) and in a
JupyterLab kernel driven by headless chromium (the browser test's helpers), alternating.

    python -m bench.lab_timing --rounds 3 --variants pm,lab          # medians of 3 each
    python -m bench.lab_timing --rounds 1 --variants pm2,lab0        # 2 torch threads; lab with OPDKIT_LIVE=0

pm: papermill without OMP_NUM_THREADS (as a kernel gets it); pm2: with OMP_NUM_THREADS=2; lab: JupyterLab
(live view); lab0: JupyterLab with the live view off. One JSON line per run goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import test_browser as tb  # noqa: E402

NOTEBOOK = "notebooks/02_whitebox.ipynb"


def _seconds(start: str, end: str) -> float:
    t = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return round((t(end) - t(start)).total_seconds(), 1)


def train_cell_seconds(nb: dict) -> float:
    cell = next(c for c in nb["cells"] if "whitebox.run(" in "".join(c["source"]))
    if "papermill" in cell["metadata"]:
        return _seconds(
            cell["metadata"]["papermill"]["start_time"], cell["metadata"]["papermill"]["end_time"]
        )
    ex = cell["metadata"]["execution"]  # JupyterLab's recordTiming
    return _seconds(ex["iopub.execute_input"], ex["shell.execute_reply"])


def papermill(threads: str | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="opdkit-timing-"))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"OMP_NUM_THREADS": threads} if threads else {})
    env.update(PYTHONPATH=str(ROOT), OPDKIT_RUNS=str(tmp / "runs"))
    out = tmp / "out.ipynb"
    cmd = [
        sys.executable,
        "-m",
        "papermill",
        str(ROOT / NOTEBOOK),
        str(out),
        "-k",
        "python3",
        "--cwd",
        str(ROOT / "notebooks"),
    ]
    subprocess.run(cmd, env=env, capture_output=True, check=True)
    return {"train_cell_s": train_cell_seconds(json.loads(out.read_text()))}


def lab(env_extra: dict | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="opdkit-timing-"))
    tb.USER_SETTINGS["@jupyterlab/notebook-extension:tracker"] = {
        "windowingMode": "none",
        "recordTiming": True,
    }
    saved = os.environ.pop("OMP_NUM_THREADS", None)  # what a user's `jupyter lab` has
    try:
        with (
            tb.jupyter_lab(tmp, env_extra) as (base, _),
            tb.browser_page(tb.shutil.which("chromium")) as page,
        ):
            tb.open_notebook(page, base, NOTEBOOK)
            tb.run_all(page, 1800)
            errors = tb.saved_errors(page, base, NOTEBOOK)
            nb = json.load(urllib.request.urlopen(f"{base}/api/contents/{NOTEBOOK}?content=1"))["content"]
            return {"errors": errors, "train_cell_s": train_cell_seconds(nb)}
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


VARIANTS = {
    "pm": lambda: papermill(None),
    "pm2": lambda: papermill("2"),
    "lab": lab,
    "lab0": lambda: lab({"OPDKIT_LIVE": "0"}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="pm,lab")
    ap.add_argument("--out", default="runs/bench/lab_timing.jsonl")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for i in range(a.rounds):
        for v in a.variants.split(","):
            load = os.getloadavg()
            res = {
                "variant": v,
                "round": i,
                **VARIANTS[v](),
                "load_before": [round(x, 2) for x in load],
                "load_after": [round(x, 2) for x in os.getloadavg()],
                "at": time.strftime("%H:%M:%S"),
            }
            with out.open("a") as fh:
                fh.write(json.dumps(res) + "\n")
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
