"""Episodes sampled ahead (`rollout_ahead 1`) against synchronous episodes, side by side: steps/s and CPU time
per step (the trainer's, and the producer's read from /proc), alternating runs of 10 steps, steps 3-10 timed.

    OMP_NUM_THREADS=1 python -m bench.episodes_ahead 3 runs/episodes-ahead    # 3 pairs

The whitebox job on the tiny tool world (`tiny:teacher-tools` as the student, the calculator, 2 turns, 8
episodes a step). Not in `make bench`'s registry: a measurement of issue 48, kept with its command.
"""

import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, sys, time, multiprocessing
import torch; torch.set_num_threads(1)
from transformers import TrainerCallback
from opdkit.jobs import whitebox
ahead, out = int(sys.argv[1]), sys.argv[2]
class Clock(TrainerCallback):
    def __init__(self): self.t = []
    def on_step_end(self, args, state, control, **kw):
        prod = [p for p in multiprocessing.active_children() if p.name == "opdkit-rollouts"]
        pcpu = 0.0
        if prod:
            f = open(f"/proc/{prod[0].pid}/stat").read().split(")")[-1].split()
            pcpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        self.t.append((time.perf_counter(), time.process_time(), pcpu))
c = Clock()
over = dict(dataset_path="tiny-tools", student_model="tiny:teacher-tools", teacher_model="tiny:teacher",
            environment="calculator", max_turns=2, max_prompt_length=96, rollout_max_new_tokens=100,
            episode_max_tokens=160, subset_size=80, per_device_train_batch_size=8, max_steps=10, eval_size=0,
            sample_every=0, checkpoint_every=0, rollout_ahead=ahead, run_dir=out, overwrite=True)
whitebox.run("tiny", over, callbacks=[c])
(w0, c0, p0), (w1, c1, p1) = c.t[1], c.t[-1]
n = len(c.t) - 2
print(json.dumps({"ahead": ahead, "steps": n, "steps_per_s": n / (w1 - w0),
                  "trainer_cpu_s_per_step": (c1 - c0) / n, "producer_cpu_s_per_step": (p1 - p0) / n}))
"""
env = {**os.environ, "OMP_NUM_THREADS": "1"}
OUT = sys.argv[2] if len(sys.argv) > 2 else "runs/episodes-ahead"
res = []
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for ahead in (0, 1):
        p = subprocess.run(
            [sys.executable, "-c", CHILD, str(ahead), os.path.join(OUT, f"run{ahead}")],
            env=env,
            capture_output=True,
            text=True,
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("{")]
        if not line:
            print(p.stderr[-3000:])
            sys.exit(1)
        r = json.loads(line[-1])
        r["rep"] = rep
        res.append(r)
        print(json.dumps(r), flush=True)
for a in (0, 1):
    rs = [r for r in res if r["ahead"] == a]
    print(
        a,
        {
            k: round(statistics.median(r[k] for r in rs), 4)
            for k in ("steps_per_s", "trainer_cpu_s_per_step", "producer_cpu_s_per_step")
        },
    )
