"""Glue for the notebooks' first cells: turn the `parameters` cell (and papermill's injected cell)
into a mode and overrides, refusing names that are not fields.

    mode, overrides = notebook_parameters(WhiteboxConfig, globals())   # what `whitebox.parameters` does

The parameters are the assignments written in those cells, read from the kernel's input history
(IPython's `In`), not every global of the kernel: running all cells again in the same kernel, or a
scratch variable, adds nothing; a line deleted from the parameters cell is gone at its next run; an
edited value takes effect. The parameters cell is the most recently executed cell that assigns `mode`
at top level; papermill's injected cell (first line `# Parameters`) counts when it ran after it.

papermill only warns about an unknown `-p name value` and runs on; here any such name stops the run
with the command line's one line (`config.check_keys`): the closest names, if any.
"""

from __future__ import annotations

import ast
import types

from opdkit.config import DEFAULT_MODE, NOTEBOOK_ONLY, RunFields, check_keys

IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}
INJECTED_HEADER = "# Parameters"  # papermill's first line of the cell it injects


def notebook_parameters(cls: type[RunFields], namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's parameters cell; None values mean 'keep the preset's'.

    `namespace` is the notebook's `globals()`; its `In` history gives the cells' sources. Without a
    history (a plain script or dict), its plain values are the parameters."""
    history = [s for s in namespace.get("In") or [] if isinstance(s, str)]
    if history:
        values = parameters_from_history(history, namespace)
    else:
        values = {
            k: v
            for k, v in namespace.items()
            if not k.startswith("_")
            and k not in IPYTHON_NAMES
            and not isinstance(v, types.ModuleType)
            and not callable(v)
        }
    settings = {k: v for k, v in values.items() if k not in NOTEBOOK_ONLY}
    check_keys(cls, settings, "the notebook's parameters cell")
    mode = values.pop("mode", None) or DEFAULT_MODE
    return mode, values


def parameters_from_history(history: list[str], namespace: dict | None = None) -> dict:
    """The assignments of the last executed parameters cell, updated by papermill's injected cell if that
    ran after it; {} if no cell in `history` assigns `mode`."""
    params_at = next((i for i in range(len(history) - 1, -1, -1) if _is_parameters_cell(history[i])), None)
    if params_at is None:
        return {}
    values = cell_assignments(history[params_at], namespace)
    injected = [s for s in history[params_at + 1 :] if s.lstrip().startswith(INJECTED_HEADER)]
    if injected:
        values.update(cell_assignments(injected[-1], namespace))
    return values


def _is_parameters_cell(source: str) -> bool:
    return not source.lstrip().startswith(INJECTED_HEADER) and "mode" in _assigned(source)


def _assigned(source: str) -> dict[str, ast.expr]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    found: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node.value
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            found[node.targets[0].id] = node.value
    return found


def cell_assignments(source: str, namespace: dict | None = None) -> dict:
    """{name: value} of a cell's top-level `name = value` / `name: type = value` lines. Values are
    literals (papermill writes reprs); any other expression is evaluated against `namespace`."""
    values = {}
    for name, node in _assigned(source).items():
        try:
            values[name] = ast.literal_eval(node)
        except ValueError:
            expr = ast.Expression(body=node)
            values[name] = eval(compile(expr, "<parameters>", "eval"), dict(namespace or {}))  # noqa: S307
    return values
