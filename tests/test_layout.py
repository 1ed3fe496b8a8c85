"""The package's rooms, checked from the source: library, jobs and entry points import only what they may,
nothing imports in a circle, modules stay small, and the kit installs and runs anywhere (`pip install .`)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "opdkit"
ENTRY_POINTS = {"opdkit.whitebox", "opdkit.savegrad", "opdkit.cliplesson", "opdkit.antidistill"}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """Every opdkit module `path` imports, at any depth of the file (lazy imports count too)."""
    found = set()
    known = modules()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("opdkit")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opdkit"):
            for a in node.names:  # `from opdkit import tasks` imports the module opdkit.tasks
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return found


def job_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "jobs" else None


def test_the_library_imports_no_job():
    for name, path in modules().items():
        if job_of(name) or name in ENTRY_POINTS or name == "opdkit.jobs":
            continue
        bad = sorted(i for i in imports(path) if i.startswith("opdkit.jobs"))
        assert not bad, f"{name} (library) imports {bad}; the library imports no job"


def test_a_job_uses_another_job_only_through_its_package():
    """A job may call another job's run() (`from opdkit.jobs import whitebox`), never its internals."""
    for name, path in modules().items():
        mine = job_of(name)
        if not mine:
            continue
        for imported in imports(path):
            other = job_of(imported)
            assert other in (None, mine) or imported == f"opdkit.jobs.{other}", (
                f"{name} imports {imported}, the internals of another job; call its run() instead"
            )


def test_no_import_cycle():
    graph = {name: {i for i in imports(path) if i in modules()} for name, path in modules().items()}
    for (
        name
    ) in graph:  # a package's __init__ is imported by its submodules implicitly; only explicit edges count
        graph[name].discard(name)
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(trail[trail.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_modules_stay_small_and_main_blocks_only_call_main():
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        assert len(lines) <= MAX_LINES, (
            f"{name} has {len(lines)} lines (at most {MAX_LINES}); split it by concept"
        )
        tree = ast.parse(path.read_text())
        for i, node in enumerate(tree.body):
            if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test):
                body = [ast.unparse(n) for n in node.body]
                assert len(body) == 1 and "main(" in body[0], (
                    f"{name}: below `if __name__ == '__main__':` {body}"
                )
                assert i == len(tree.body) - 1, f"{name}: code after `if __name__ == '__main__':`"


def test_presets_ship_inside_the_package():
    from opdkit.config import PARAMS_DIR, available_modes

    assert PARAMS_DIR.is_relative_to(PACKAGE)
    assert {"tiny", "full"} <= set(available_modes("02_whitebox"))


def test_runs_go_under_the_working_folder_or_opdkit_runs(tmp_path, monkeypatch):
    from opdkit import runs

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(runs.RUNS_ENV, raising=False)
    assert runs.new_run_path("02_whitebox", "tiny").parent == tmp_path / "runs" / "02_whitebox"
    monkeypatch.setenv(runs.RUNS_ENV, str(tmp_path / "elsewhere"))
    assert runs.new_run_path("02_whitebox", "tiny").parent == tmp_path / "elsewhere" / "02_whitebox"


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
    (run,) = list((work / "runs" / "02_whitebox").iterdir())
    assert (run / "summary.json").is_file() and len((run / "metrics.jsonl").read_text().splitlines()) == 3
