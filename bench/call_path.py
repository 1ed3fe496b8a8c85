"""The path of one 04 sweep point through the kit's calls: how many opdkit functions its data passes, in how
many modules (places), and how often a call climbs back to a higher floor.

    OMP_NUM_THREADS=1 python -m bench.call_path              # one ADS point of antidistill tiny, 4 SFT steps
    OMP_NUM_THREADS=1 python -m bench.call_path --set attackers=[sft,opd] max_steps=2 --out /tmp/cp.json
    cd /tmp/old && PYTHONPATH=/tmp/old python <this repo>/bench/call_path.py    # an older checkout, /tmp/old

It runs antidistill in this process (`--mode`, default tiny, narrowed by `POINT` to one ADS point, λ 0.05 at
τ 1, 64 traces, 4 SFT steps, 32 evaluation problems; `--set` changes any setting, values read as YAML) and
traces, with `sys.setprofile`, every call from the moment the sweep process starts its point
(`points.point_result`, the function that runs one sweep point safely, as `spread.run_point_safely` did) until
that point returns. Everything before (the savegrad gradient, the models loaded, the baseline) is left out.

What is counted:
- a **function** is an opdkit code object entered: functions, methods, nested functions and lambdas written
  in opdkit's files, told apart by module and qualified name; code that dataclasses generate (`__init__`,
  `__eq__`) is not. Comprehensions, generator expressions and module bodies are not
  functions here: a call from inside one is the enclosing function's call. A generator counts when it is
  first entered, not at each resumption.
- a **place** is the module (`__name__`) of a function passed.
- the **caller** of a function is the nearest counted opdkit function below it on the stack, with the
  frames of other packages (transformers' Trainer, torch) skipped: a Trainer calling an opdkit callback is
  the opdkit function that called the Trainer calling it.
- a **climb** is a call whose caller's module sits in a lower room than the callee's, by the rooms of
  `tests/test_layout.py` (`ROOMS`: 0 config/tiny/params ... 8 jobs/build, 9 the entry points), e.g. the
  run lifecycle's `run_safely` calling the job's lambda. `climbs` counts distinct (caller, callee) pairs;
  `climb_calls` counts every such call.
- a **descent** is the other way, a module calling into a module of a lower room; `descents` counts distinct
  (caller module, callee module) pairs. Each one's return brings the data back up a floor; on the code
  before #37 this gives 18, the number #37 quotes for "climbs back up" (how that one was counted is not
  recorded; climbs as defined above are 3 there).

An older checkout is measured by running this file from it (`python -m` would put the working folder's opdkit
first): its `opdkit/params` must be its own presets (`ln -s ../params /tmp/old/opdkit/params` where the
presets sit at the top, as `pyproject.toml` maps them); the first line says where both were imported from.

Printed: the three figures (functions / places / climbs), the places with their room and how many
functions each holds, and every climb (caller -> callee, with its count); `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import dis
import functools
import json
import os
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_layout import ROOMS  # noqa: E402  (the one ranking of the rooms)

PACKAGE = "opdkit"
# One ADS point of the tiny sweep, small enough for a minute of CPU; older checkouts take the same names.
POINT = {
    "lams": [0.05],
    "answer_lams": [],
    "temperatures": [],
    "subset_size": 64,
    "eval_size": 32,
    "sft_max_steps": 4,
    "sft_batch_size": 16,
}
NOT_FUNCTIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<module>")
RESUMABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
FIRST_ENTRY = bytes([dis.opmap["RESUME"], 0])  # where a frame stands when first entered (3.11+)


@functools.cache
def room(module: str) -> int:
    """The module's room: its longest matching prefix in `ROOMS`."""
    best = max((p for p in ROOMS if module == p or module.startswith(p + ".")), key=len)
    return ROOMS[best]


@dataclass
class CallPath:
    """The opdkit calls seen while `sys.setprofile(path.profile)` is on (the module's docstring)."""

    package: str = PACKAGE
    functions: Counter = field(default_factory=Counter)  # (module, qualname) -> calls
    climbs: Counter = field(default_factory=Counter)  # ((module, qualname), (module, qualname)) -> calls
    descents: Counter = field(default_factory=Counter)  # (module, module) -> calls, to a lower room
    _kind: dict = field(default_factory=dict)  # code -> "function", "inside" (comprehension, module) or None

    def kind(self, code: CodeType, frame: FrameType) -> str | None:
        if code not in self._kind:
            module = frame.f_globals.get("__name__", "")
            ours = module == self.package or module.startswith(self.package + ".")
            written = not code.co_filename.startswith("<")  # not made by exec (a dataclass's __init__)
            self._kind[code] = (
                None if not (ours and written) else "inside" if code.co_name in NOT_FUNCTIONS else "function"
            )
        return self._kind[code]

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        if self.kind(code, frame) != "function":
            return
        if code.co_flags & RESUMABLE and code.co_code[frame.f_lasti : frame.f_lasti + 2] != FIRST_ENTRY:
            return  # a generator resumed (RESUME 1), not entered (RESUME 0)
        callee = (frame.f_globals["__name__"], code.co_qualname)
        self.functions[callee] += 1
        caller = frame.f_back
        while caller is not None and self.kind(caller.f_code, caller) != "function":
            caller = caller.f_back
        if caller is not None:
            here = (caller.f_globals["__name__"], caller.f_code.co_qualname)
            if room(here[0]) < room(callee[0]):
                self.climbs[(here, callee)] += 1
            elif room(here[0]) > room(callee[0]):
                self.descents[(here[0], callee[0])] += 1

    def __enter__(self) -> CallPath:
        threading.setprofile(self.profile)  # threads started inside (none expected) are traced too
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]

    def places(self) -> Counter:
        """Module -> how many distinct functions of it were passed."""
        return Counter(module for module, _ in self.functions)

    def summary(self) -> dict:
        name = lambda f: f"{f[0]}.{f[1]}"  # noqa: E731
        return {
            "functions": len(self.functions),
            "places": len(self.places()),
            "climbs": len(self.climbs),
            "climb_calls": sum(self.climbs.values()),
            "descents": len(self.descents),
            "functions_list": {f"{m}.{q}": n for (m, q), n in sorted(self.functions.items())},
            "calls": sum(self.functions.values()),
            "places_list": {m: {"room": room(m), "functions": n} for m, n in sorted(self.places().items())},
            "climbs_list": [
                {
                    "caller": name(a),
                    "caller_room": room(a[0]),
                    "callee": name(b),
                    "callee_room": room(b[0]),
                    "calls": n,
                }
                for (a, b), n in self.climbs.items()
            ],
        }


def traced_point(mode: str, overrides: dict) -> CallPath:
    """Run antidistill with `overrides` in this process, tracing its sweep points (one, with `POINT`)."""
    from opdkit.jobs.antidistill import job
    from opdkit.jobs.antidistill import points as pt

    path, point_result = CallPath(), pt.point_result

    def traced(*args, **kwargs):
        with path:
            return point_result(*args, **kwargs)

    pt.point_result = traced  # job.process calls it through the module
    try:
        job.run(mode, overrides)
    finally:
        pt.point_result = point_result
    return path


def report(summary: dict) -> str:
    lines = [
        f"one sweep point: {summary['functions']} functions / {summary['places']} places / "
        f"{summary['climbs']} climbs ({summary['climb_calls']} climbing calls of {summary['calls']}); "
        f"{summary['descents']} descents (module pairs)",
        "places (room, functions passed):",
        *(f"  {r['room']}  {m}  {r['functions']}" for m, r in summary["places_list"].items()),
        "climbs (caller room -> callee room, calls):",
        *(
            f"  {c['caller_room']} -> {c['callee_room']}  {c['caller']} -> {c['callee']}  ({c['calls']})"
            for c in summary["climbs_list"]
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="tiny", help="antidistill preset")
    ap.add_argument(
        "--set",
        nargs="*",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="settings over the preset and POINT (values read as YAML)",
    )
    ap.add_argument("--out", default="", help="also write the figures and lists here (JSON)")
    a = ap.parse_args(argv)
    overrides = {**POINT, **{k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}}
    import opdkit.params

    import opdkit

    code, presets = Path(opdkit.__file__).parent, Path(opdkit.params.__file__).parent
    print(f"opdkit from {code}, its presets from {presets}", flush=True)
    with tempfile.TemporaryDirectory() as runs:
        os.environ["OPDKIT_RUNS"] = runs  # the run's folder is thrown away with its point
        summary = {
            "opdkit": str(code),
            "presets": str(presets),
            "mode": a.mode,
            "overrides": overrides,
            **traced_point(a.mode, overrides).summary(),
        }
    print(report(summary))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
