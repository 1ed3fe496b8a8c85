"""`make demo`: every notebook with its default parameters, executed headless by papermill.

    python -m opdkit.notebook.demo --out runs/demo notebooks/*.ipynb

Each notebook runs with its default parameters, or the ones its metadata names for the demo (its
metadata's `demo` entry under the kit's key; none names any now), writes its run directory inside
`<out>/<stamp>/` and its executed copy next to it. The notebooks are independent (04 computes its own
gradient) and the tiny world trains on one thread, so they run side by side, one per CPU core (`--jobs`),
the longest first (`demo_seconds` in the metadata: 05, which trains the whole tool preset); one that fails
does not stop the others. The end prints where the executed notebooks, summaries and
figures are, and what a reader of an executed notebook in JupyterLab would trip over (`reader_problems`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path


def kit_metadata(nb: Path) -> dict:
    """The notebook's metadata under the kit's key (`opdkit`), or none."""
    return json.loads(nb.read_text()).get("metadata", {}).get("opdkit", {})


def demo_parameters(nb: Path) -> dict:
    """The parameters the notebook's metadata sets for the demo (the `demo` entry under the
    metadata's `opdkit` key), or none."""
    return kit_metadata(nb).get("demo", {})


def demo_seconds(nb: Path) -> float:
    """About how long the notebook's demo run takes alone on a 2-core CPU (its metadata's `demo_seconds`
    under the kit's key; 0 where it does not say): the demo starts the longest first, so the one that takes
    longest does not start last."""
    return float(kit_metadata(nb).get("demo_seconds", 0))


def start_order(notebooks: list[Path]) -> list[Path]:
    """The notebooks longest first (`demo_seconds`), in their given order where they say the same."""
    return sorted(notebooks, key=lambda nb: -demo_seconds(nb))


def run_notebook(nb: Path, out: Path) -> tuple[Path, Path, float]:
    import papermill as pm

    run_dir = out / nb.stem
    executed = out / nb.name
    t0 = time.time()
    pm.execute_notebook(
        str(nb),
        str(executed),
        parameters={**demo_parameters(nb), "run_dir": str(run_dir)},
        kernel_name="python3",
        cwd=str(nb.parent),
        progress_bar=False,
        log_output=False,
    )
    return executed, run_dir, time.time() - t0


SHOWN_OUTPUTS = 50  # JupyterLab shows a cell's first 50 outputs, then "Show more outputs"
WIDGET = "application/vnd.jupyter.widget-view+json"


def reader_problems(notebook: dict) -> list[str]:
    """What a reader of an executed notebook meets in JupyterLab, per code cell: more outputs than it shows
    (the last ones, a summary table among them, behind "Show more outputs"; counted as saved, before
    JupyterLab merges neighbouring stream outputs), transformers' step tables, and widget outputs without a
    static view (which read "Error displaying widget" once the kernel is gone)."""
    bad = []
    for i, cell in enumerate(notebook.get("cells", [])):
        outs = cell.get("outputs", [])
        shown = len(outs)
        tables = sum("Training Loss" in str(o.get("data", {}).get("text/html", "")) for o in outs)
        widgets = sum(
            WIDGET in o.get("data", {}) and not {"text/html", "image/png"} & set(o["data"]) for o in outs
        )
        if shown > SHOWN_OUTPUTS:
            bad.append(f"cell {i}: {shown} outputs, JupyterLab shows {SHOWN_OUTPUTS}")
        if tables:
            bad.append(f"cell {i}: {tables} transformers step table(s)")
        if widgets:
            bad.append(f"cell {i}: {widgets} widget output(s) without a static view")
    return bad


def _headline(summary: dict) -> dict:
    """Scalar entries as they are; per-arm entries (dicts) reduced to their final accuracy."""
    out = {}
    for k, v in summary.items():
        if k == "arms" and isinstance(v, dict):  # cliplesson: each arm's final accuracy
            out.update({f"{arm}.final_accuracy": e.get("final_accuracy") for arm, e in v.items()})
        elif isinstance(v, dict):
            if "final_accuracy" in v:
                out[f"{k}.final_accuracy"] = v["final_accuracy"]
        elif not isinstance(v, list):
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument(
        "--jobs", type=int, default=0, help="notebooks run side by side (default: one per CPU core)"
    )
    a = p.parse_args(argv)
    out = (a.out / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True)
    jobs = max(1, min(a.jobs or os.cpu_count() or 1, len(a.notebooks)))
    print(f"running {len(a.notebooks)} notebooks, {jobs} at a time, into {out} ...", flush=True)
    t_all, rows, failed = time.time(), {}, []
    spawn = multiprocessing.get_context("spawn")  # each worker starts its kernels afresh
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn) as pool:
        futures = {pool.submit(run_notebook, nb.resolve(), out): nb for nb in start_order(a.notebooks)}
        for future in concurrent.futures.as_completed(futures):
            nb = futures[future]
            try:
                executed, run_dir, secs = future.result()
            except Exception as exc:  # papermill has already written the failing notebook
                print(f"FAILED {nb}: {type(exc).__name__}: {str(exc)[:2000]}", file=sys.stderr, flush=True)
                print(f"the executed notebook with the error: {out / nb.name}", file=sys.stderr, flush=True)
                failed.append(nb)
                continue
            rows[nb] = (nb.name, executed, run_dir, secs)
            print(f"  {nb} done in {secs:.0f} s", flush=True)
            for problem in reader_problems(json.loads(executed.read_text())):
                print(f"  for a reader in JupyterLab: {problem}", flush=True)
    if failed:
        return 1
    print(f"\nmake demo finished in {time.time() - t_all:.0f} s; everything is under {out}\n")
    for nb in a.notebooks:
        name, executed, run_dir, secs = rows[nb]
        print(f"{name}  ({secs:.0f} s)\n  executed notebook: {executed}")
        summary = run_dir / "summary.json"
        if summary.exists():
            headline = _headline(json.loads(summary.read_text()))
            print(f"  summary: {json.dumps(headline)[:400]}")
        for fig in sorted(run_dir.glob("figures/*.png")):
            print(f"  figure: {fig}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
