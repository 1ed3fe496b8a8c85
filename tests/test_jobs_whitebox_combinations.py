"""opdkit.jobs.whitebox.combinations: every teacher kind x rollout source x engine x processes is tested,
built or refused by the job's checks in one line; docs/combinations.md holds the rendered table verbatim;
every test it names exists; the combinations issue 48 builds are tested; a combination that names a test and
is refused cannot be rendered."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from opdkit.jobs.whitebox import combinations as combos

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def statuses():
    return combos.statuses()


def test_docs_hold_the_generated_table():
    text = (ROOT / "docs" / "combinations.md").read_text()
    block = text.split(combos.BEGIN, 1)[1].split(combos.END, 1)[0]
    assert block == "\n" + combos.table(), (
        "docs/combinations.md's table is stale: "
        "python -m opdkit.jobs.whitebox.combinations docs/combinations.md"
    )


def test_every_named_test_exists():
    for file, name in combos.TESTED.values():
        tree = ast.parse((ROOT / "tests" / file).read_text())
        functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in functions, (file, name)
    assert set(combos.TESTED) <= {c.key for c in combos.combinations()}


def test_every_combination_has_a_status_and_each_refusal_is_one_line(statuses):
    assert len(statuses) == len(combos.KINDS) * len(combos.SOURCES) * len(combos.ENGINES) * len(
        combos.PROCESSES
    )
    for c, (status, what) in statuses.items():
        assert status in ("tested", "built", "refused"), c
        if status == "refused":
            assert what and "\n" not in what and ("use " in what or "set " in what), (c, what)


def test_what_issue_48_builds_is_tested(statuses):
    for kind, source in (
        ("in process", "episodes, ahead"),
        ("in process", "episodes, ahead, corrected"),
        ("served, top-K", "episodes"),
        ("another tokenizer, served", "episodes"),
    ):
        assert statuses[combos.Combination(kind, source, "hf", "1")][0] == "tested", (kind, source)


def test_a_refused_combination_that_names_a_test_is_an_error(monkeypatch):
    key = ("another tokenizer, served top-K", "episodes", "hf", "1")
    monkeypatch.setitem(combos.TESTED, key, ("test_x.py", "test_y"))
    with pytest.raises(ValueError, match="is refused"):
        combos.statuses()
