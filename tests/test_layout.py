"""The package's rooms, checked from the source. Each rule is a function that lists the violations in a
tree, so that every rule is tested twice: on this repository (no violation) and on a copy broken on purpose
(the violation is found).

Rooms, from the bottom up; a module imports its own room and rooms of a lower rank only (`ROOMS`):
  0  opdkit.config, opdkit.tiny (the shipped tiny world), opdkit.params
  1  opdkit.models, opdkit.memory (the memory plan), opdkit.run (run folders, files, launching, sharding,
     tracking, cli)
  2  opdkit.rollout (sampling, engines, evaluation)
  3  opdkit.data (prompts, tasks, answers, traces, SFT)
  4  opdkit.opd, opdkit.ads (the two methods, independent of each other)
  5  opdkit.notebook, opdkit.tiny.build (the tiny world's recipe)
  6  opdkit.jobs (one folder per job; another job only through its package), opdkit.tiny.teacher_bpe (the
     tiny recipe again, for a byte-level BPE teacher)
  7  the entry points `python -m opdkit.<job>`
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent
JOBS = ("savegrad", "whitebox", "cliplesson", "antidistill")
ENTRY_POINTS = {f"opdkit.{job}" for job in JOBS}
ROOMS = {  # the longest matching prefix decides a module's room
    "opdkit": 0,
    "opdkit.config": 0,
    "opdkit.params": 0,
    "opdkit.tiny": 0,
    "opdkit.models": 1,
    "opdkit.memory": 1,
    "opdkit.run": 1,
    "opdkit.rollout": 2,
    "opdkit.data": 3,
    "opdkit.opd": 4,
    "opdkit.ads": 4,
    "opdkit.notebook": 5,
    "opdkit.tiny.build": 5,
    "opdkit.tiny.teacher_bpe": 6,  # the tiny recipe (opdkit.tiny.build) again, for a byte-level BPE teacher
    "opdkit.jobs": 6,
    **{name: 7 for name in ENTRY_POINTS},
}


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = REPO) -> dict[str, Path]:
    return {module_name(p, root): p for p in (root / "opdkit").rglob("*.py")}


def imports(path: Path, known: dict[str, Path]) -> dict[str, set[str]]:
    """Every opdkit module `path` imports (lazy imports too), with the names it takes from each."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("opdkit"):
                    found.setdefault(a.name, set())
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opdkit"):
            for a in node.names:  # `from opdkit.data import tasks` imports the module opdkit.data.tasks
                sub = f"{node.module}.{a.name}"
                if sub in known:
                    found.setdefault(sub, set())
                else:
                    found.setdefault(node.module, set()).add(a.name)
    return found


def room(name: str) -> str:
    return max((r for r in ROOMS if name == r or name.startswith(r + ".")), key=len)


def job_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "jobs" else None


def private_imports(root: Path = REPO) -> list[str]:
    """A name starting with `_` imported from another module, or reached as `module._name` of an imported
    opdkit module: a private name crossing modules."""
    known, bad = modules(root), []
    for name, path in known.items():
        found = imports(path, known)
        for mod, names in found.items():
            bad += [f"{name} imports {mod}.{n}" for n in names if n.startswith("_") and n != "__version__"]
        aliases = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opdkit"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
            ):
                bad.append(f"{name} uses {aliases[node.value.id]}.{node.attr}")
    return bad


def upward_imports(root: Path = REPO) -> list[str]:
    """An import of a room of a higher rank, or of another room of the same rank; and a job's import of
    another job's internals (another job is reached through its package: `from opdkit.jobs import
    whitebox`)."""
    known, bad = modules(root), []
    for name, path in known.items():
        mine = room(name)
        for imported in imports(path, known):
            theirs = room(imported)
            if theirs != mine and ROOMS[theirs] >= ROOMS[mine]:
                bad.append(
                    f"{name} (room {mine}, rank {ROOMS[mine]}) imports {imported} (rank {ROOMS[theirs]})"
                )
            other = job_of(imported)
            if job_of(name) and other not in (None, job_of(name)) and imported != f"opdkit.jobs.{other}":
                bad.append(f"{name} imports {imported}, the internals of another job")
    return bad


def import_cycles(root: Path = REPO) -> list[str]:
    known = modules(root)
    graph = {n: {i for i in imports(p, known) if i in known} - {n} for n, p in known.items()}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def main_blocks(root: Path = REPO) -> list[str]:
    """An entry point holds its docstring, imports and `if __name__ == "__main__": main()` alone; elsewhere
    nothing but the call of `main` stands below `if __name__ == "__main__":`, and nothing after it."""
    bad = []
    for name, path in modules(root).items():
        tree = ast.parse(path.read_text())
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
                body = [ast.unparse(n) for n in node.body]
                if len(body) != 1 or "main(" not in body[0] or i != len(tree.body) - 1:
                    bad.append(f"{name}: below `if __name__ == '__main__':` {body}")
        if name in ENTRY_POINTS:
            rest = [
                n
                for n in tree.body
                if not isinstance(n, (ast.Import, ast.ImportFrom, ast.If))
                and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
            ]
            if rest:
                bad.append(f"{name} is an entry point; it holds {[ast.unparse(n)[:40] for n in rest]}")
    return bad


def notebook_imports(root: Path = REPO) -> list[str]:
    """A notebook imports its job's package (`from opdkit.jobs import whitebox`) and that job's report, and
    nothing else of opdkit."""
    bad = []
    for nb in sorted((root / "notebooks").glob("*.ipynb")):
        code = "\n".join(
            "".join(c["source"])
            for c in json.loads(nb.read_text())["cells"]
            if c["cell_type"] == "code" and not "".join(c["source"]).lstrip().startswith(("!", "%"))
        )
        jobs = set()
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module == "opdkit.jobs":
                jobs |= {a.name for a in node.names}
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import) and any(a.name.startswith("opdkit") for a in node.names):
                bad.append(f"{nb.name}: import {', '.join(a.name for a in node.names)}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opdkit"):
                ok = node.module == "opdkit.jobs" or (
                    node.module in {f"opdkit.jobs.{j}" for j in jobs}
                    and [a.name for a in node.names] == ["report"]
                )
                if not ok:
                    names = ", ".join(a.name for a in node.names)
                    bad.append(f"{nb.name}: from {node.module} import {names}")
        if len(jobs) != 1:
            bad.append(f"{nb.name} imports the jobs {sorted(jobs)}; a notebook calls one job")
    return bad


def unlisted_packages(root: Path = REPO) -> list[str]:
    """Every folder of opdkit/ with an __init__.py is in pyproject's explicit package list (a mapped params/
    means setuptools cannot find them itself), and params/ is mapped to opdkit.params."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {module_name(p, root) for p in (root / "opdkit").rglob("__init__.py")} | {"opdkit.params"}
    bad = [f"{p} is not in pyproject's [tool.setuptools] packages" for p in sorted(found - listed)]
    bad += [f"{p} is listed but has no folder" for p in sorted(listed - found)]
    if tool.get("package-dir", {}).get("opdkit.params") != "params":
        bad.append("params/ is not mapped to opdkit.params in [tool.setuptools.package-dir]")
    return bad


def readme_layout(root: Path = REPO) -> list[str]:
    """The README's layout block names every room of the package (each folder of opdkit/, each module at
    its top) and names nothing that is not there."""
    text = (root / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    rooms = {p.name + "/" for p in (root / "opdkit").iterdir() if (p / "__init__.py").is_file()}
    rooms |= {p.name for p in (root / "opdkit").glob("*.py") if p.name != "__init__.py"}
    bad = [f"the README's layout does not name opdkit/{r}" for r in sorted(rooms) if r not in block]
    named = {w.split("/")[0] for line in block.splitlines() for w in line.split()[:1] if w.endswith("/")}
    bad += [
        f"the README's layout names {w}/, which is not in the repository"
        for w in sorted(named)
        if not (root / w).is_dir() and not (root / "opdkit" / w).is_dir() and w != "jobs"
    ]
    return bad


NOT_MODULES = {"layout", "bench", "params", "notebooks", "notebooks_jupyterlab"}  # tests of other folders


def mirrored_test_names(root: Path = REPO) -> list[str]:
    """Tests mirror the package: `test_<room>_<module>[_<aspect>].py` names the module (or subpackage) it
    tests, e.g. test_rollout_engines.py tests opdkit/rollout/engines.py, test_rollout_engines_vllm.py its vLLM
    engine, test_jobs_whitebox.py opdkit/jobs/whitebox/; a few test folders outside the package
    (`NOT_MODULES`)."""
    bad = []
    for path in sorted((root / "tests").glob("test_*.py")):
        name = path.stem[len("test_") :]
        if name in NOT_MODULES:
            continue
        where, parts = root / "opdkit", name.split("_")
        while parts and (where / parts[0]).is_dir():
            where = where / parts.pop(0)
        if parts and (where / f"{parts[0]}.py").is_file():
            where = where / parts.pop(0)
        if where == root / "opdkit" or len(parts) > 1:  # at most one word of aspect after the module
            bad.append(f"tests/{path.name} names no module of opdkit (left over: {'_'.join(parts)})")
    return bad


RULES = [
    mirrored_test_names,
    private_imports,
    upward_imports,
    import_cycles,
    main_blocks,
    notebook_imports,
    unlisted_packages,
    readme_layout,
]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_the_repository_keeps_the_rule(rule):
    assert rule() == []


def broken_copy(tmp_path: Path, edits: dict[str, str]) -> Path:
    """A copy of the package, notebooks and pyproject with `edits` (path -> text appended)."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "opdkit", root / "opdkit", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copytree(REPO / "notebooks", root / "notebooks")
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    shutil.copy(REPO / "README.md", root / "README.md")
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in edits.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((path.read_text() if path.exists() else "") + text)
    return root


def _notebook_importing(line: str) -> str:
    nb = json.loads((REPO / "notebooks" / "02_whitebox.ipynb").read_text())
    nb["cells"].append({"cell_type": "code", "metadata": {}, "outputs": [], "source": [line]})
    return json.dumps(nb)


BREAKS = {  # rule -> (edits, a fragment of the violation it must report)
    "private_imports": (
        {"opdkit/opd/trainer.py": "\nfrom opdkit.rollout.engines import _on_cpu\n"},
        "_on_cpu",
    ),
    "upward_imports": (
        {"opdkit/data/prompts.py": "\nfrom opdkit.opd import trainer\n"},
        "opdkit.opd.trainer",
    ),
    "import_cycles": ({"opdkit/config.py": "\nfrom opdkit import models\n"}, "opdkit.config"),
    "main_blocks": ({"opdkit/whitebox.py": "\nprint('hello')\n"}, "entry point"),
    "unlisted_packages": ({"opdkit/extra/__init__.py": ""}, "opdkit.extra"),
    "readme_layout": ({"opdkit/extra/__init__.py": ""}, "opdkit/extra/"),
    "mirrored_test_names": ({"tests/test_whatever.py": ""}, "test_whatever.py"),
}


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_the_rule_finds_a_deliberate_violation(rule, tmp_path):
    if rule is notebook_imports:
        root = broken_copy(tmp_path, {})
        (root / "notebooks" / "02_whitebox.ipynb").write_text(
            _notebook_importing("from opdkit.notebook.widgets import sample_browser")
        )
        expected = "opdkit.notebook.widgets"
    else:
        edits, expected = BREAKS[rule.__name__]
        root = broken_copy(tmp_path, edits)
    found = rule(root)
    assert any(expected in v for v in found), found


def test_presets_live_at_the_top_of_the_repository():
    from opdkit.config import PARAMS_DIR, available_modes
    from opdkit.jobs.whitebox.config import WhiteboxConfig

    assert PARAMS_DIR == REPO / "params"  # the editable install maps opdkit.params to params/
    assert {"tiny", "full"} <= set(available_modes(WhiteboxConfig))
    assert {p.name for p in PARAMS_DIR.iterdir() if p.is_dir()} == set(JOBS)


def test_runs_go_under_the_working_folder_or_opdkit_runs(tmp_path, monkeypatch):
    from opdkit.run import folders

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(folders.RUNS_ENV, raising=False)
    assert folders.new_run_path("whitebox", "tiny").parent == tmp_path / "runs" / "whitebox"
    monkeypatch.setenv(folders.RUNS_ENV, str(tmp_path / "elsewhere"))
    assert folders.new_run_path("whitebox", "tiny").parent == tmp_path / "elsewhere" / "whitebox"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_plain_install_runs_from_an_unrelated_folder(tmp_path):
    """`pip install .` (not editable) into a fresh virtualenv; the job finds its presets and tiny world in the
    installed package and writes under the working folder's ./runs. The kit's dependencies come from this
    interpreter's site-packages (no downloads), the kit itself only from the wheel."""
    wheels, env_dir, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "somewhere"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A plain path line: the dependencies' folder joins sys.path, its own .pth files (an editable opdkit)
    # do not.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "-q",
            *map(str, wheels.glob("*.whl")),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPDKIT_RUNS", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [python, "-m", "opdkit.whitebox", "--mode", "tiny", "--set", "max_steps=3", "eval_size=10"],
        cwd=work,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = subprocess.run(
        [python, "-c", "import opdkit; print(opdkit.__file__)"], cwd=work, capture_output=True, text=True
    ).stdout
    assert str(env_dir) in where, f"opdkit was imported from {where}, not from the plain install"
    (run,) = list((work / "runs" / "whitebox").iterdir())
    assert (run / "summary.json").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) == 3
