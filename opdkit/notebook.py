"""Glue for the notebooks' first cells: turn the `parameters` cell (and papermill's injected cell)
into a mode and overrides, refusing names that are not fields.

    mode, overrides = notebook_parameters("02_whitebox", globals())

papermill only warns about an unknown `-p name value` and runs on; here any such name stops the run
with an error that lists the valid ones.
"""

from __future__ import annotations

import types

from opdkit.config import DEFAULT_MODE, NOTEBOOK_ONLY, ConfigError, available_modes, field_names

IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


def notebook_parameters(job: str, namespace: dict) -> tuple[str, dict]:
    """(mode, overrides) from the notebook's global names; None values mean 'keep the preset's'."""
    user = {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_") and k not in IPYTHON_NAMES and not isinstance(v, types.ModuleType) and not callable(v)
    }
    valid = set(field_names(job)) | NOTEBOOK_ONLY
    unknown = sorted(set(user) - valid)
    if unknown:
        raise ConfigError(
            f"unknown parameter(s) {unknown} for {job}; valid: {', '.join(sorted(valid))} "
            f"(modes: {', '.join(available_modes(job))})."
        )
    mode = user.pop("mode", None) or DEFAULT_MODE
    return mode, user
