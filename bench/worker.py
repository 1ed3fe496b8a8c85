"""One measurement in this (fresh) process; prints its result as one JSON line (after RESULT_PREFIX).

    python -m bench.worker p1_opd_step opdkit '{"models": "tiny", "batch": 4, ...}'

`bench.runner.run_worker` starts this; run it by hand to debug one side of one benchmark.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from bench.registry import WORKERS

RESULT_PREFIX = "BENCH_RESULT "  # how the result line is marked for `bench.runner.run_worker`


def measure(bench: str, side: str, params: dict) -> dict[str, Any]:
    """Run one side of one benchmark here, with `params["threads"]` intra-op threads."""
    if bench not in WORKERS:
        raise ValueError(f"unknown benchmark {bench!r}; expected one of {list(WORKERS)}")
    module = WORKERS[bench].module()
    if side not in module.SIDES:
        raise ValueError(f"side {side!r} is not one of {module.SIDES} for {bench}")
    import torch

    torch.set_num_threads(int(params.get("threads", 1)))
    return module.measure(side, params)


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(f"usage: python -m bench.worker {{{','.join(WORKERS)}}} SIDE PARAMS_JSON")
    print(RESULT_PREFIX + json.dumps(measure(argv[0], argv[1], json.loads(argv[2]))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
