"""Behaviour kept across a refactor: every tiny preset run for a few steps, its per-step metrics and summary
written to one JSON file, then two such files compared.

    python -m bench.behaviour run --out runs/behaviour/before.json      # on the code before the change
    python -m bench.behaviour run --out runs/behaviour/after.json       # on the code after it
    python -m bench.behaviour compare runs/behaviour/before.json runs/behaviour/after.json

`--only NAME ...` runs some of the cases. Timings, paths and dates are left out of the comparison; every other
number must agree to `--rtol` (default 1e-6: the same arithmetic in the same order gives the same bits, and
a refactor that moves code must keep it so).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# name: (job, mode, settings). A few steps each, small evaluations: what the code does, not how it learns.
SHORT = ["eval_size=40", "eval_every=0", "checkpoint_every=0", "sample_every=2"]
CASES: dict[str, tuple[str, str, list[str]]] = {
    "whitebox-tiny": ("whitebox", "tiny", ["max_steps=4", *SHORT]),
    "whitebox-crosstok": ("whitebox", "tiny-crosstok", ["max_steps=3", *SHORT]),
    "whitebox-tools": ("whitebox", "tiny-tools", ["max_steps=3", *SHORT]),
    "whitebox-tools-bpe": ("whitebox", "tiny-tools-bpe", ["max_steps=3", *SHORT]),
    "whitebox-ahead2": ("whitebox", "tiny", ["max_steps=4", "rollout_ahead=2", *SHORT]),
    "whitebox-ahead-truncated": (
        "whitebox",
        "tiny",
        ["max_steps=4", "rollout_ahead=1", "async_correction=truncated", *SHORT],
    ),
    "savegrad-tiny": ("savegrad", "tiny", ["subset_size=64"]),
    "cliplesson-short": ("cliplesson", "tiny", ["arm_max_steps=3", "arm_eval_size=40"]),
    "antidistill-tiny": (
        "antidistill",
        "tiny",
        [
            "sft_max_steps=4",
            "max_steps=3",
            "eval_size=40",
            "lams=[0.0,0.05]",
            "answer_lams=[]",
            "temperatures=[1.0]",
        ],
    ),
    "antidistill-attack": (
        "antidistill",
        "tiny-attack",
        [
            "sft_max_steps=4",
            "max_steps=3",
            "eval_size=40",
            "repeats=1",
            "lams=[0.0,0.05]",
            "temperatures=[1.0]",
        ],
    ),
}
IGNORED = re.compile(
    r"(time|_s$|seconds|per_s|wall|started|elapsed|date|path|dir|commit|host|machine|load|cpu"
    r"|python|version|folder|run$|created|url|pid|held)",
    re.I,
)


def _numbers(obj, prefix: str = "") -> dict[str, object]:
    """Every leaf of a JSON value under its dotted key, the ignored keys left out."""
    out: dict[str, object] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not IGNORED.search(str(k)):
                out.update(_numbers(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(_numbers(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = obj
    return out


def _collect(folder: Path) -> dict:
    """Each run folder under `folder`: its metrics.jsonl, samples.jsonl and summary.json, relative names."""
    out = {}
    for f in sorted(folder.rglob("*")):
        if f.name in ("metrics.jsonl", "samples.jsonl"):
            rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            out[str(f.relative_to(folder)).split("/", 3)[-1]] = rows
        elif f.name == "summary.json":
            out[str(f.relative_to(folder)).split("/", 3)[-1]] = json.loads(f.read_text())
    # The run folder's own name holds a date: keep only the path below it.
    return {re.sub(r"-\d{8}-\d{4,6}-[0-9a-f]+", "", k): v for k, v in out.items()}


def run(out: Path, only: list[str]) -> None:
    result = {}
    for name, (job, mode, settings) in CASES.items():
        if only and name not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "OPDKIT_RUNS": tmp, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", f"opdkit.{job}", "--mode", mode, "--set", *settings]
            print("$", " ".join(cmd), flush=True)
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
                result[name] = {"error": done.returncode}
                continue
            result[name] = _collect(Path(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def compare(before: Path, after: Path, rtol: float) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for name in sorted(set(a) - set(b)):
        print(f"{name}: not in {after}")
    for name in sorted(set(a) & set(b)):
        x, y = _numbers(a.get(name, {})), _numbers(b.get(name, {}))
        diffs = []
        for key in sorted(set(x) | set(y)):
            u, v = x.get(key, "<missing>"), y.get(key, "<missing>")
            if isinstance(u, (int, float)) and isinstance(v, (int, float)) and not isinstance(u, bool):
                if abs(u - v) <= rtol * max(abs(u), abs(v), 1e-12):
                    continue
            elif u == v:
                continue
            diffs.append(f"  {key}: {u!r} -> {v!r}")
        print(f"{name}: {'same' if not diffs else f'{len(diffs)} differ'} ({len(x)} values)")
        if diffs:
            print("\n".join(diffs[:20]))
        bad += bool(diffs)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--only", nargs="*", default=[])
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--rtol", type=float, default=1e-6)
    args = p.parse_args()
    if args.cmd == "run":
        run(args.out, args.only)
        return 0
    return compare(args.before, args.after, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
