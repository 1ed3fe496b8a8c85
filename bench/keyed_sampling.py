"""What keyed per-row sampling costs (issue 28, item 6): 02 tiny's rollouts and optimizer steps with each
row drawn from its own stream (`sampling.keyed_draw`, what the trainer does) against one stream for the
batch (`torch.multinomial` after `torch.manual_seed`, what it did), in alternating fresh processes.

    python -m bench.keyed_sampling --reps 5          # medians, their ratio, the cost as a share of a step
    python -m bench.keyed_sampling --draw            # the draw alone, microseconds per call

- `rollout`: `sampling.sample` on the tiny student at 02 tiny's step (64 prompts, 40 new tokens, T = 1), no
  stop token, so both sides decode exactly 40 positions: the median of 10 calls after 2 warm-ups;
- `step`: `python -m opdkit.whitebox --mode tiny` for 12 steps (no evaluation, no checkpoints), the median
  seconds per optimizer step over steps 3-12 (metrics.jsonl: completion_tokens / tokens_per_s, the step's
  own clock from its rollout to its log line). Both sides sample other completions, so their steps differ
  in length as well as in sampling; the rollout figure isolates the sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIDES = ("keyed", "global")


def rollout(side: str) -> dict:
    import torch

    from opdkit.models import load_model, load_tokenizer
    from opdkit.rollout import sampling
    from opdkit.tasks import tiny as tiny_task

    torch.set_num_threads(1)
    tok = load_tokenizer("tiny:student")
    model = load_model("tiny:student").eval()
    messages = [[{"role": "user", "content": p.prompt}] for p in tiny_task.training_problems(64, 1)]
    ids_BP, mask_BP = sampling.encode_prompts(tok, messages)
    seeds = list(range(64)) if side == "keyed" else None
    times = []
    for i in range(12):
        if seeds is None:
            torch.manual_seed(i)
        t0 = time.perf_counter()
        r = sampling.sample(
            model,
            ids_BP,
            mask_BP,
            eos_token_id=[len(tok) + 7],  # never sampled: every row decodes all 40 positions
            pad_token_id=tok.pad_token_id,
            max_new_tokens=40,
            row_seeds_B=seeds,
        )
        times.append(time.perf_counter() - t0)
        assert r.completion_mask_BC.shape == (64, 40)
    return {"rollout_s": statistics.median(times[2:])}


def draw() -> dict:
    """The draw alone, both sides in one process, alternating blocks of 500 calls on 02 tiny's logits (64 rows
    x the tiny vocabulary of 101) and on Qwen3's (64 x 151,936): median microseconds per call."""
    import torch

    from opdkit.rollout import sampling

    torch.set_num_threads(1)
    out = {}
    for vocab in (101, 151_936):
        logits_BV = torch.randn(64, vocab, generator=torch.Generator().manual_seed(0)) * 3
        seeds_B = torch.arange(64)
        calls = {
            "keyed": lambda i, x=logits_BV, s=seeds_B: sampling.keyed_draw(x, s, i),
            "global": lambda i, x=logits_BV: torch.multinomial(torch.softmax(x, -1), 1).squeeze(1),
        }
        blocks = 20 if vocab < 1000 else 4
        calls_per_block = 500 if vocab < 1000 else 10
        times: dict[str, list[float]] = {s: [] for s in SIDES}
        for _ in range(blocks):
            for side in SIDES:
                t0 = time.perf_counter()
                for i in range(calls_per_block):
                    calls[side](i)
                times[side].append((time.perf_counter() - t0) / calls_per_block * 1e6)
        out[f"V{vocab}"] = {s: statistics.median(times[s]) for s in SIDES}
    return out


def step(side: str) -> dict:
    from opdkit.jobs import whitebox
    from opdkit.rollout import engines

    if side == "global":  # the trainer as it was: one seed per call and process
        engines.rollout_seeds = lambda seed, step, places: engines.rollout_seed(seed, step, 0)
    with tempfile.TemporaryDirectory() as tmp:
        over = {
            "run_dir": f"{tmp}/r",
            "max_steps": 12,
            "eval_size": 0,
            "eval_every": 0,
            "sample_every": 0,
            "checkpoint_every": 0,
        }
        run = whitebox.run("tiny", over)
        steps = [r for r in run.read_jsonl() if "tokens_per_s" in r]
    per_step = [r["completion_tokens"] / r["tokens_per_s"] for r in steps[2:]]
    tokens = [r["completion_tokens"] for r in steps[2:]]
    return {"step_s": statistics.median(per_step), "tokens_per_step": statistics.median(tokens)}


def worker(kind: str, side: str) -> None:
    result = draw() if kind == "draw" else (rollout if kind == "rollout" else step)(side)
    print("RESULT " + json.dumps(result), flush=True)


def run_one(kind: str, side: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.keyed_sampling", "--worker", kind, side],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{kind} {side} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.keyed_sampling", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--draw", action="store_true", help="time the draw alone (one process, both sides)")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "SIDE"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return
    if a.draw:
        print(f"load average at start: {os.getloadavg()}", flush=True)
        print(json.dumps(run_one("draw", "both"), indent=2))
        print(f"load average at end: {os.getloadavg()}")
        return
    runs: dict[str, dict[str, list[dict]]] = {k: {s: [] for s in SIDES} for k in ("rollout", "step")}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for rep in range(a.reps):
        for kind in ("rollout", "step"):
            for side in SIDES:  # alternating: keyed, global, keyed, global, ...
                runs[kind][side].append(run_one(kind, side))
                print(f"rep {rep + 1} {kind} {side}: {runs[kind][side][-1]}", flush=True)
    med = {
        (kind, side, key): statistics.median(r[key] for r in runs[kind][side])
        for kind, key in (("rollout", "rollout_s"), ("step", "step_s"), ("step", "tokens_per_step"))
        for side in SIDES
    }
    added = med["rollout", "keyed", "rollout_s"] - med["rollout", "global", "rollout_s"]
    result = {
        "rollout_s": {s: med["rollout", s, "rollout_s"] for s in SIDES},
        "rollout_ratio": med["rollout", "keyed", "rollout_s"] / med["rollout", "global", "rollout_s"],
        "step_s": {s: med["step", s, "step_s"] for s in SIDES},
        "tokens_per_step": {s: med["step", s, "tokens_per_step"] for s in SIDES},
        "added_s_per_step": added,
        "added_share_of_a_step": added / med["step", "global", "step_s"],
        "load_average_at_end": os.getloadavg(),
        "runs": runs,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
