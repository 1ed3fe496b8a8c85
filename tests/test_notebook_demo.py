"""`make demo`'s order: the notebooks start longest first (`demo_seconds` in their metadata), so the longest
(05, which trains the whole tool preset) does not start last and the demo keeps within its minutes."""

from __future__ import annotations

import json
from pathlib import Path

from opdkit.notebook import demo

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.ipynb"))


def test_every_notebook_says_how_long_its_demo_takes_and_the_longest_starts_first():
    seconds = {nb.stem: demo.demo_seconds(nb) for nb in NOTEBOOKS}
    assert all(s > 0 for s in seconds.values()), seconds
    order = [nb.stem for nb in demo.start_order(NOTEBOOKS)]
    assert order[0] == "05_tool_use" and [seconds[n] for n in order] == sorted(seconds.values(), reverse=True)


def test_notebooks_that_do_not_say_keep_their_order_after_those_that_do(tmp_path):
    paths = []
    for name, meta in (("a", {}), ("b", {"demo_seconds": 5}), ("c", {}), ("d", {"demo_seconds": 50})):
        path = tmp_path / f"{name}.ipynb"
        path.write_text(json.dumps({"cells": [], "metadata": {"opdkit": meta} if meta else {}}))
        paths.append(path)
    assert [p.stem for p in demo.start_order(paths)] == ["d", "b", "a", "c"]
