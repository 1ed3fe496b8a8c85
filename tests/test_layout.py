"""The package's rooms, checked from the source. Each rule is a function that lists the violations in a
tree, so that every rule is tested twice: on this repository (no violation) and on a copy broken on purpose
(the violation is found).

Rooms, from the bottom up; a module imports its own room and rooms of a lower rank only (`ROOMS`):
  0  opdkit.config and opdkit.settings (every settings group, torch-free), opdkit.tiny (the shipped tiny
     world), opdkit.params
  1  opdkit.models, opdkit.memory (the memory plan)
  2  opdkit.run (the run lifecycle, run folders, files, checkpoints, launching, spreading work, sharding,
     tracking, cli)
  3  opdkit.rollout (sampling, engines, greedy decoding)
  4  opdkit.data (prompts, labels, traces, data files)
  5  opdkit.tasks (the tiny task, math tasks, grading, accuracy)
  6  opdkit.sft, opdkit.opd (two methods, independent of each other)
  7  opdkit.ads (antidistillation; its scoring teacher is a kind of opd's teacher in process)
  8  opdkit.notebook
  9  opdkit.jobs (one folder per job; another job only through its package), opdkit.build (the tiny world's
     recipe)
  10 the entry points `python -m opdkit.<job>`
"""

from __future__ import annotations

import ast
import json
import os
import re
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
    "opdkit": 0,  # opdkit.config and opdkit.settings: one room, the configuration
    "opdkit.params": 0,
    "opdkit.tiny": 0,
    "opdkit.models": 1,
    "opdkit.memory": 1,
    "opdkit.run": 2,
    "opdkit.rollout": 3,
    "opdkit.data": 4,
    "opdkit.tasks": 5,
    "opdkit.sft": 6,
    "opdkit.opd": 6,
    "opdkit.ads": 7,  # its teacher is a kind of opd's teacher in process (`ads.teacher.ADSTeacher`)
    "opdkit.notebook": 8,
    "opdkit.jobs": 9,
    "opdkit.build": 9,
    **{name: 10 for name in ENTRY_POINTS},
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


REPORTS = {"report", "tooluse", "ahead"}  # a job's report modules a notebook may import


def notebook_imports(root: Path = REPO) -> list[str]:
    """A notebook imports its job's package (`from opdkit.jobs import whitebox`) and that job's report (05
    also whitebox's report of a tool-use run, `tooluse`), and nothing else of opdkit but the progress bars
    it installs first (`from opdkit.notebook import progress`)."""
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
                names = [a.name for a in node.names]
                ok = (
                    node.module == "opdkit.jobs"
                    or (node.module == "opdkit.notebook" and names == ["progress"])
                    or (
                        node.module in {f"opdkit.jobs.{j}" for j in jobs}
                        and set(names) <= REPORTS
                        and "report" in names
                    )
                )
                if not ok:
                    bad.append(f"{nb.name}: from {node.module} import {', '.join(names)}")
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
    """The layout block of docs/architecture.md (the README links to it) names every room of the package
    (each folder of opdkit/, each module at its top) and names nothing that is not there."""
    text = (root / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    rooms = {p.name + "/" for p in (root / "opdkit").iterdir() if (p / "__init__.py").is_file()}
    rooms |= {p.name for p in (root / "opdkit").glob("*.py") if p.name != "__init__.py"}
    bad = [f"the architecture page's layout lacks opdkit/{r}" for r in sorted(rooms) if r not in block]
    named = {w.split("/")[0] for line in block.splitlines() for w in line.split()[:1] if w.endswith("/")}
    bad += [
        f"the architecture page's layout names {w}/, which is not in the repository"
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
        # the module, whose own name may hold a '_' (test_build_tiny_world.py: opdkit/build/tiny_world.py)
        k = next((k for k in range(len(parts), 0, -1) if (where / f"{'_'.join(parts[:k])}.py").is_file()), 0)
        if k:
            where, parts = where / "_".join(parts[:k]), parts[k:]
        if where == root / "opdkit" or len(parts) > 1:  # at most one word of aspect after the module
            bad.append(f"tests/{path.name} names no module of opdkit (left over: {'_'.join(parts)})")
    return bad


def teacher_kind_classes(root: Path = REPO) -> set[str]:
    """The teacher kinds' class names: every class of opdkit/opd/teachers/'s own modules but the interface's
    (`base`: what the trainer holds), and every class of opdkit named `...Teacher` or `...Teachers` (the kinds
    in their packages: `ServedTeacher`, `TopKTeacher`, `RoutedTeacher`, `CrossTokenizerTeacher`, `ADSTeacher`,
    ...)."""
    names = set()
    for path in (root / "opdkit").rglob("*.py"):
        kinds_room = path.parent == root / "opdkit" / "opd" / "teachers" and path.name != "base.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (
                kinds_room or (node.name.endswith(("Teacher", "Teachers")) and node.name != "Teacher")
            ):
                names.add(node.name)
    return names


def teacher_kinds_in_trainer(root: Path = REPO) -> list[str]:
    """`DistillTrainer` names no teacher kind: no kind's class name (`teacher_kind_classes`) appears in
    opd/trainer.py, neither imported nor used (an isinstance, a type check, a docstring that says which
    kind it branches on). It asks its `teachers.base.Teacher` instead, so a new kind is a new file in
    opdkit/opd/teachers/ and its test, and the trainer does not change."""
    path = root / "opdkit" / "opd" / "trainer.py"
    words = set(re.findall(r"\b\w+\b", path.read_text()))
    return [f"opd/trainer.py names the teacher kind {k}" for k in sorted(teacher_kind_classes(root) & words)]


# The trainer and the teacher kinds; of `teachers.cross`, the kind and the re-tokenized rows (its GOLD maths,
# `settings`, `alignment`, `divergence`, `sortedl1`, `tokenbytes`, read completions alone).
LOSS_PATH = (
    "opdkit/opd/trainer.py",
    *(f"opdkit/opd/teachers/{m}.py" for m in ("base", "local", "sets")),
    "opdkit/opd/teachers/served",
    "opdkit/opd/teachers/topk",
    "opdkit/opd/teachers/cross/teacher.py",
    "opdkit/opd/teachers/cross/retokenize.py",
    "opdkit/ads/teacher.py",
)


def completion_without_the_mask(root: Path = REPO) -> list[str]:
    """The loss reads the rollout record's per-token loss mask (`loss_mask_BT`), never "everything after the
    prompt": in the loss path (`LOSS_PATH`: the trainer, the teacher kinds, the cross-tokenizer teacher's
    rows) no code names the completion-shaped mask (`completion_mask_BC`, a key or an attribute) or a prompt
    length (`prompt_len`), and none subtracts one tensor's width from another's (`ids.shape[1] -
    comp.shape[1]`, how a prompt length is derived from a completion block). Each of these assumes one segment
    after one prompt, which a multi-turn episode (tool outputs inside the row) breaks silently."""
    bad = []
    for rel in LOSS_PATH:
        where = root / rel
        for path in sorted(where.rglob("*.py") if where.is_dir() else [where]):
            name = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text())):
                words = []
                if isinstance(node, ast.Name):
                    words = [node.id]
                elif isinstance(node, ast.Attribute):
                    words = [node.attr]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    words = re.findall(r"\w+", node.value) if len(node.value) < 40 else []
                for w in words:
                    if w in ("completion_mask_BC", "prompt_len"):
                        bad.append(f"{name}:{node.lineno} reads {w}, not the loss mask")
                if (
                    isinstance(node, ast.BinOp)
                    and isinstance(node.op, ast.Sub)
                    and all("shape" in ast.unparse(side) for side in (node.left, node.right))
                ):
                    bad.append(f"{name}:{node.lineno} derives a prompt length: {ast.unparse(node)}")
    return bad


def _classes(root: Path) -> dict[str, tuple[Path, list[str]]]:
    """Every class of opdkit by name: its file and its bases' names (the last dotted part)."""
    out = {}
    for path in (root / "opdkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                out[node.name] = (path, bases)
    return out


def _subclasses_of(base: str, classes: dict[str, tuple[Path, list[str]]]) -> set[str]:
    """The classes of opdkit that derive from `base`, directly or through other opdkit classes."""
    found: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, (_, bases) in classes.items():
            if name not in found and any(b == base or b in found for b in bases):
                found.add(name)
                grew = True
    return found


TEACHER_HOMES = ("opdkit/opd/teachers", "opdkit/ads/teacher.py")  # the ADS teacher is a kind where it lives


def teacher_kinds_in_one_place(root: Path = REPO) -> list[str]:
    """Each teacher kind is one class, in one place: every class of opdkit named `...Teacher` or
    `...Teachers` is a `teachers.base.Teacher` (no module class beside a kind class that wraps it, paired by
    a type table), and every `Teacher` lives under opdkit/opd/teachers/ (the ADS-scored teacher in
    opdkit/ads/teacher.py, where antidistillation keeps it), holding its client, head and checks there."""
    classes = _classes(root)
    kinds = _subclasses_of("Teacher", classes)
    bad = []
    for name, (path, _) in sorted(classes.items()):
        rel = path.relative_to(root).as_posix()
        named = name.endswith(("Teacher", "Teachers")) and name != "Teacher"
        if named and name not in kinds:
            bad.append(
                f"{rel}: {name} is named a teacher but is no Teacher kind (a second class for one kind)"
            )
        if name in kinds and not rel.startswith(TEACHER_HOMES):
            bad.append(f"{rel}: the teacher kind {name} lives outside opdkit/opd/teachers/")
    return bad


TRAINER_ROLLOUT_IMPORTS = {"opdkit.rollout.source", "opdkit.rollout.build"}


def trainer_names_no_rollout_kind(root: Path = REPO) -> list[str]:
    """`DistillTrainer` names no rollout kind and no engine: of opdkit.rollout it imports only the interface
    and its records (`rollout.source`) and what builds a source from the settings (`rollout.build`), and no
    rollout source's class (a `RolloutSource` subclass) or engine class (`...Engine`) appears in
    opd/trainer.py, neither imported nor used (an isinstance, a docstring that says which kind it branches
    on). A new rollout source is then a class in opdkit/rollout/ and a line in `build`, and the trainer does
    not change."""
    path = root / "opdkit" / "opd" / "trainer.py"
    known = modules(root)
    bad = [
        f"opd/trainer.py imports {m}, a rollout kind or engine (only {sorted(TRAINER_ROLLOUT_IMPORTS)})"
        for m in sorted(imports(path, known))
        if m.startswith("opdkit.rollout") and m not in TRAINER_ROLLOUT_IMPORTS
    ]
    classes = _classes(root)
    sources = _subclasses_of("RolloutSource", classes)
    engines = {n for n, (p, _) in classes.items() if n.endswith("Engine") and "rollout" in p.parts}
    words = set(re.findall(r"\b\w+\b", path.read_text()))
    bad += [
        f"opd/trainer.py names the rollout kind or engine {k}" for k in sorted((sources | engines) & words)
    ]
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
    teacher_kinds_in_trainer,
    teacher_kinds_in_one_place,
    trainer_names_no_rollout_kind,
    completion_without_the_mask,
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
    shutil.copytree(REPO / "docs", root / "docs", ignore=shutil.ignore_patterns("*.png"))
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
    "teacher_kinds_in_trainer": (
        {"opdkit/opd/trainer.py": "\n\ndef _approximate(t):\n    return isinstance(t, topk.TopKTeacher)\n"},
        "TopKTeacher",
    ),
    "teacher_kinds_in_one_place": (
        {
            "opdkit/opd/teachers/topk/teacher.py": (
                "\n\nclass PromptLogprobsTeacher(torch.nn.Module):\n    pass\n"
            ),
            "opdkit/jobs/whitebox/teacher.py": (
                "\n\nfrom opdkit.opd.teachers.local import LocalTeacher\n\n\n"
                "class JobTeacher(LocalTeacher):\n    pass\n"
            ),
        },
        "PromptLogprobsTeacher",
    ),
    "trainer_names_no_rollout_kind": (
        {"opdkit/opd/trainer.py": "\n\nfrom opdkit.rollout.ahead import AheadRollouts\n"},
        "opdkit.rollout.ahead",
    ),
    "completion_without_the_mask": (
        {
            "opdkit/opd/trainer.py": (
                "\n\ndef _completion(inputs):\n"
                "    P = inputs['input_ids'].shape[1] - inputs['completion_mask_BC'].shape[1]\n"
                "    return inputs['input_ids'][:, P:]\n"
            )
        },
        "completion_mask_BC",
    ),
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


def setting_declarations(root: Path = REPO) -> dict[str, list[str]]:
    """Every setting (a class attribute declared with `setting(...)`) by name: the classes declaring it."""
    found: dict[str, list[str]] = {}
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and isinstance(stmt.value, ast.Call)
                    and getattr(stmt.value.func, "id", None) == "setting"
                ):
                    found.setdefault(stmt.target.id, []).append(f"{name}.{node.name}")
    return found


def settings_declared_twice(root: Path = REPO) -> list[str]:
    """A setting's name is declared in one config class (a settings group) only: a job that wants another
    default says so in its preset, and a name means one thing everywhere."""
    return [
        f"{field} is declared in {', '.join(where)}"
        for field, where in sorted(setting_declarations(root).items())
        if len(where) > 1
    ]


def old_names_accepted(root: Path = REPO) -> list[str]:
    """A setting's old name (`config.RENAMED`) is accepted nowhere: no settings group declares it again, no
    preset sets it, and `config.check_keys`, the one door every preset, `--set` and notebook parameter goes
    through, refuses it first (`check_renamed`)."""
    tree = ast.parse((root / "opdkit" / "config.py").read_text())
    old: set[str] = set()
    refuses = False
    for node in ast.walk(tree):
        target = getattr(node, "target", None)
        if isinstance(node, ast.AnnAssign) and getattr(target, "id", None) == "RENAMED":
            old = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.FunctionDef) and node.name == "check_keys":
            refuses = any(
                isinstance(c, ast.Call) and getattr(c.func, "id", None) == "check_renamed"
                for c in ast.walk(node)
            )
    bad = [] if refuses else ["config.check_keys does not call check_renamed: old names reach the settings"]
    bad += [
        f"{name} (renamed) is declared again in {', '.join(where)}"
        for name, where in sorted(setting_declarations(root).items())
        if name in old
    ]
    for preset in sorted((root / "params").rglob("*.yaml")) if (root / "params").is_dir() else []:
        keys = set((yaml_load(preset.read_text()) or {}).keys())
        bad += [f"{preset.relative_to(root)} sets {k} (renamed)" for k in sorted(keys & old)]
    return bad


def yaml_load(text: str):
    import yaml

    return yaml.safe_load(text)


NOTEBOOK_JOBS = {
    "01_save_grad": "savegrad",
    "02_whitebox": "whitebox",
    "03_clip_vs_noclip": "cliplesson",
    "04_antidistill": "antidistill",
    "05_tool_use": "whitebox",
}
GPU_PRESETS = {"05_tool_use": "tools-full"}  # a notebook's GPU preset, when not its job's `full`
GPU_LINE = re.compile(r"^#\s*(\w+)\s*:\s*\w+\s*=\s*(.+?)\s*(?:#.*)?$")


def gpu_block_drift(root: Path = REPO) -> list[str]:
    """Each notebook's parameters cell lists, commented out, the fields a GPU run sets; every value there is
    the job's `full` preset's (05: `tools-full`), resolved (its `extends` chain, the fields' defaults)."""
    import dataclasses

    import yaml

    from opdkit.config import load_config

    configs = job_configs()
    bad = []
    for stem, job in NOTEBOOK_JOBS.items():
        nb = json.loads((root / "notebooks" / f"{stem}.ipynb").read_text())
        cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
        lines = "".join(cell["source"]).splitlines()
        block = lines[next(i for i, line in enumerate(lines) if "A GPU run" in line) + 1 :]
        name = GPU_PRESETS.get(stem, "full")
        preset = dataclasses.asdict(load_config(configs[job], name, params_dir=root / "params"))
        for line in block:
            m = GPU_LINE.match(line)
            if not m:
                continue
            field, shown = m.group(1), yaml.safe_load(m.group(2))
            if field not in preset:
                bad.append(f"{stem}: {field} is not a field of {job}")
            elif shown != preset[field]:
                bad.append(
                    f"{stem}: {field} = {shown!r}, but params/{job}/{name}.yaml gives {preset[field]!r}"
                )
    return bad


def job_configs() -> dict[str, type]:
    from opdkit.jobs import antidistill, cliplesson, savegrad, whitebox

    return {j.JOB.name: j.JOB.config for j in (antidistill, cliplesson, savegrad, whitebox)}


CITED = re.compile(r"\bopdkit(?:\.[A-Za-z_]\w*)+")


def module_file(dotted: str, root: Path) -> Path | None:
    if dotted == "opdkit.params" or dotted.startswith("opdkit.params."):
        return root / "params" / "__init__.py" if dotted == "opdkit.params" else None
    base = root / Path(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def defined(path: Path, names: list[str], root: Path, depth: int = 0) -> bool:
    """Is `names` (a top-level name, then an attribute of a class) defined in the module at `path`? Imported
    names are followed to their module."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == names[0]:
            if len(names) == 1:
                return True
            if isinstance(node, ast.ClassDef):
                return any(
                    getattr(s, "name", None) == names[1]
                    or (isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == names[1])
                    or (
                        isinstance(s, ast.Assign)
                        and any(getattr(t, "id", None) == names[1] for t in s.targets)
                    )
                    for s in node.body
                )
            return False
        targets = []
        if isinstance(node, ast.Assign):
            targets = [getattr(t, "id", None) for t in node.targets]
        elif isinstance(node, ast.AnnAssign):
            targets = [getattr(node.target, "id", None)]
        if names[0] in targets:
            return len(names) == 1
        if isinstance(node, ast.ImportFrom) and node.module and depth < 5:
            for a in node.names:
                if (a.asname or a.name) == names[0] and node.module.startswith("opdkit"):
                    return resolves(".".join([node.module, a.name, *names[1:]]), root, depth + 1)
    return False


def resolves(dotted: str, root: Path = REPO, depth: int = 0) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]), root)
        if path is not None:
            rest = parts[cut:]
            return not rest or (len(rest) <= 2 and defined(path, rest, root, depth))
    return False


def cited_names(root: Path = REPO) -> list[str]:
    """Every `opdkit.*` name the READMEs, the notebooks and the package's own text (docstrings, comments,
    messages) cite is a module, or a name defined in one (a class's attribute too)."""
    texts = {p: p.read_text() for p in (root / "opdkit").rglob("*.py")}
    texts |= {p: p.read_text() for p in [root / "README.md", *(root / "notebooks").glob("*.ipynb")]}
    bench = root / "bench" / "README.md"
    if bench.is_file():
        texts[bench] = bench.read_text()
    bad = set()
    for path, text in texts.items():
        for name in set(CITED.findall(text)):
            if not resolves(name, root):
                bad.add(f"{path.relative_to(root)} cites {name}, which does not exist")
    return sorted(bad)


# Library modules whose tests live in other files, with where; every other library module has
# tests/test_<room>_<module>*.py, and a job's modules have tests/test_jobs_<job>*.py.
UNTESTED = {
    "opdkit.ads.gradfile": "tests/test_ads_gradient.py: saved by a savegrad run, loaded, and every refusal "
    "(names, shapes, missing tensors, another tokenizer, a module prefix); tests/test_ads_direction.py: "
    "another model's",
    "opdkit.memory.plans": "tests/test_memory.py: the reserve, the table, suggestions replanned, largest "
    "batches, and plans against measured peaks; tests/test_memory_jobs.py: every job's full preset",
    "opdkit.memory.shapes": "tests/test_memory.py: parameter counts against transformers and by hand, config "
    "sources",
    "opdkit.notebook.demo": "`make demo` itself runs it (every notebook, headless)",
    "opdkit.notebook.figures": "drawn from real runs: tests/test_jobs_whitebox.py (the curves with held-out "
    "accuracy, the accuracy bars), tests/test_notebooks.py (02's three figures saved; slow)",
    "opdkit.opd.stage": "distill_stage's plan: tests/test_memory_stages.py (tokens and rows per stage) and "
    "tests/test_memory_components.py (its components against hand counts); tests/test_memory_jobs.py: every "
    "job's preset",
    "opdkit.notebook.live": "a kernel's view: tests/test_notebooks.py (headless plain logs, OPDKIT_LIVE=1's "
    "one live figure; slow) and tests/test_notebooks_jupyterlab.py",
    "opdkit.notebook.parameters": "tests/test_config.py: the parameters cell from the kernel's history, "
    "papermill's injected cell, unknown names refused",
    "opdkit.opd.arguments": "tests/test_jobs_whitebox.py (the global batch over any process count; every "
    "run's arguments, max_grad_norm 0 never clipping in the gradient checks), tests/test_ads_teacher.py and "
    "tests/test_models.py (OPDArguments built directly)",
    "opdkit.opd.build": "tests/test_jobs_whitebox.py (every 02 run's trainer, 03's arms are 02 runs) and "
    "tests/test_jobs_antidistill_points_attackers.py (04's on-policy attackers)",
    "opdkit.opd.callbacks": "tests/test_jobs_whitebox.py: GradientDump is the gradient checks' window into a "
    "step, StepAccuracy logs eval_every's accuracy",
    "opdkit.opd.teachers.served.checks": "tests/test_opd_teachers_served.py (the package's tests against a "
    "stub server: state_gap on final-norm and other states, the start checks' refusals, the tokenizer, a "
    "resume against another model), tests/test_opd_teachers_served_vllm.py (the start checks against a real "
    "server)",
    "opdkit.opd.teachers.served.client": "tests/test_opd_teachers_served.py: decoding both encodings and "
    "refusing misshapen answers, retries then one error naming the URL, timeouts, the key from the "
    "environment and a 401/403 in one line",
    "opdkit.opd.teachers.served.wiring": "tests/test_jobs_whitebox_served.py (a job's start check, a server "
    "gone mid-run, teacher_server local started and stopped, teacher_gpus split, the local server's plan), "
    "tests/test_opd_teachers_served.py (local_server's command)",
    "opdkit.opd.trainer": "tests/test_jobs_whitebox.py (a step's gradient against TRL's loss, batch shape "
    "and process count, resume, non-finite steps), tests/test_ads_teacher.py (a step with the ADS teacher), "
    "tests/test_models.py (rollouts end at the stop list)",
    "opdkit.tasks.base": "the interface the tasks implement; its shared methods run through them: "
    "tests/test_tasks_math.py and tests/test_data_prompts.py (load_prompts), tests/test_rollout_greedy.py "
    "(forced_prefix)",
}


def untested_modules(root: Path = REPO) -> list[str]:
    """Every library module has a test file named after it (`mirrored_test_names`: opdkit.run.files in
    tests/test_run_files*.py); a job's modules (opdkit.jobs.<job>.*: its recipe, config, report) count as
    tested when the job has tests (tests/test_jobs_<job>*.py), which cover them together. A module without
    one is listed in `UNTESTED` with the reason, which names test files that exist, for a module that does;
    entry points and package `__init__`s are exempt."""
    tests = [p.stem[len("test_") :] for p in (root / "tests").glob("test_*.py")]
    known = modules(root)
    bad = [f"UNTESTED lists {name}, which is no module" for name in UNTESTED if name not in known]
    for name, reason in UNTESTED.items():
        for cited in re.findall(r"tests/(test_\w+\.py)", reason):
            if not (root / "tests" / cited).is_file():
                bad.append(f"UNTESTED[{name!r}] cites tests/{cited}, which does not exist")
    for name, path in sorted(known.items()):
        if path.name == "__init__.py" or name in ENTRY_POINTS or name in UNTESTED:
            continue
        job = job_of(name)
        stem = f"jobs_{job}" if job else name.removeprefix("opdkit.").replace(".", "_")
        if not any(t == stem or t.startswith(stem + "_") for t in tests):
            bad.append(f"{name} has no tests/test_{stem}*.py (nor a reason in UNTESTED)")
    return bad


DOC_RULES = [settings_declared_twice, old_names_accepted, gpu_block_drift, cited_names, untested_modules]
DOC_BREAKS = {
    "settings_declared_twice": (
        {
            "opdkit/jobs/cliplesson/config.py": (
                "\n\n@dataclass\nclass Extra:\n    seed: int = setting(1, 'x')\n"
            )
        },
        "seed is declared in",
    ),
    "old_names_accepted": (
        {
            "opdkit/jobs/cliplesson/config.py": (
                "\n\n@dataclass\nclass Old:\n    eval_steps: int = setting(0, 'x')\n"
            )
        },
        "eval_steps (renamed) is declared again",
    ),
    "cited_names": ({"README.md": "\nSee `opdkit.tasks.nowhere` for more.\n"}, "opdkit.tasks.nowhere"),
    "untested_modules": ({"opdkit/tasks/lonely.py": '"""A module nobody tests."""\n'}, "opdkit.tasks.lonely"),
}


@pytest.mark.parametrize("rule", DOC_RULES, ids=lambda r: r.__name__)
def test_the_repository_keeps_the_doc_rule(rule):
    assert rule() == []


@pytest.mark.parametrize("rule", DOC_RULES, ids=lambda r: r.__name__)
def test_the_doc_rule_finds_a_deliberate_violation(rule, tmp_path):
    if rule is gpu_block_drift:
        root = broken_copy(tmp_path, {})
        shutil.copytree(REPO / "params", root / "params")
        nb = root / "notebooks" / "02_whitebox.ipynb"
        shown, other = (
            '# teacher_model: str = \\"Qwen/Qwen3-4B\\"',
            '# teacher_model: str = \\"Qwen/Qwen3-8B\\"',
        )
        nb.write_text(nb.read_text().replace(shown, other))
        expected = "teacher_model"
    else:
        edits, expected = DOC_BREAKS[rule.__name__]
        root = broken_copy(tmp_path, edits)
    found = rule(root)
    assert any(expected in v for v in found), found


def doc_pages(root: Path = REPO) -> list[Path]:
    """The user's pages: the README and the reference pages in docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def doc_pages_cited_names(root: Path = REPO) -> list[str]:
    """`cited_names` for the pages in docs/: every `opdkit.*` name they cite is a module, or a name defined in
    one. A room that does not exist yet is cited as a path (`opdkit/rollout/source.py`), which names a
    file, not an import."""
    bad = set()
    for path in doc_pages(root)[1:]:
        for name in set(CITED.findall(path.read_text())):
            if not resolves(name, root):
                bad.add(f"{path.relative_to(root)} cites {name}, which does not exist")
    return sorted(bad)


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def doc_links(root: Path = REPO) -> list[str]:
    """Every relative link of the README and of docs/*.md (pages, figures) leads to a file that exists."""
    bad = []
    for path in doc_pages(root):
        for target in LINK.findall(path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                bad.append(f"{path.relative_to(root)} links to {target}, which does not exist")
    return bad


COMMAND = re.compile(r"python -m opdkit\.(\w+)\b(.*)$|papermill notebooks/(\w+)\.ipynb\b(.*)$")


def doc_commands(root: Path = REPO) -> list[str]:
    """The commands the README and docs/*.md show (`python -m opdkit.<job> --mode M --set k=v`, `papermill
    notebooks/<nb>.ipynb -p k v`, the GPU runs among them) name a preset of that job and fields of its
    config: a renamed setting or mode breaks the page's command, and this rule, together."""
    import dataclasses

    configs, jobs = job_configs(), {stem: job for stem, job in NOTEBOOK_JOBS.items()}
    bad = []
    for path in doc_pages(root):
        for line in path.read_text().splitlines():
            m = COMMAND.search(line.split("#", 1)[0] if "papermill" in line else line)
            if not m:
                continue
            job, rest = (m.group(1), m.group(2)) if m.group(1) else (jobs.get(m.group(3)), m.group(4))
            if job not in configs:
                continue
            fields = {f.name for f in dataclasses.fields(configs[job])}
            words = rest.split("#", 1)[0].replace("'", " ").split()
            for flag, value in zip(words, words[1:]):
                names = []
                if flag == "--mode" or (flag == "-p" and value == "mode"):
                    mode = value if flag == "--mode" else words[words.index(value) + 1]
                    if not (root / "params" / job / f"{mode}.yaml").is_file():
                        bad.append(f"{path.relative_to(root)}: {job} has no mode {mode} ({line.strip()})")
                elif flag == "--set":
                    names = [w.split("=")[0] for w in words[words.index(value) :] if "=" in w]
                elif flag == "-p":
                    names = [value]
                bad += [
                    f"{path.relative_to(root)}: {name} is not a setting of {job} ({line.strip()})"
                    for name in names
                    if name not in fields
                ]
    return sorted(set(bad))


PAGE_RULES = [doc_pages_cited_names, doc_links, doc_commands]
PAGE_BREAKS = {  # rule -> (edits, a fragment of the violation it must report)
    "doc_pages_cited_names": ({"docs/memory.md": "\nSee `opdkit.memory.nowhere`.\n"}, "memory.nowhere"),
    "doc_links": ({"docs/verdicts.md": "\nSee [the gone page](gone.md).\n"}, "gone.md"),
    "doc_commands": (
        {
            "docs/full-runs.md": "\n    python -m opdkit.whitebox --mode full --set teacher_srv=http://x:8000\n"
        },
        "teacher_srv",
    ),
}


@pytest.mark.parametrize("rule", PAGE_RULES, ids=lambda r: r.__name__)
def test_the_pages_keep_the_rule(rule):
    assert rule() == []


@pytest.mark.parametrize("rule", PAGE_RULES, ids=lambda r: r.__name__)
def test_the_page_rule_finds_a_deliberate_violation(rule, tmp_path):
    edits, expected = PAGE_BREAKS[rule.__name__]
    root = broken_copy(tmp_path, edits)
    shutil.copytree(REPO / "params", root / "params")
    found = rule(root)
    assert any(expected in v for v in found), found


def test_an_old_name_let_through_is_found(tmp_path):
    """`old_names_accepted`'s other two doors: check_keys without check_renamed, a preset with an old name."""
    root = broken_copy(tmp_path, {})
    config = root / "opdkit" / "config.py"
    config.write_text(config.read_text().replace("    check_renamed(cls, keys, where)\n", "", 1))
    shutil.copytree(REPO / "params", root / "params")
    preset = root / "params" / "whitebox" / "tiny.yaml"
    preset.write_text(preset.read_text() + "\nsave_steps: 3\n")
    found = old_names_accepted(root)
    assert any("does not call check_renamed" in v for v in found), found
    assert any("sets save_steps (renamed)" in v for v in found), found
