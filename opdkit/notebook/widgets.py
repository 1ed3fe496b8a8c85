"""ipywidgets views for JupyterLab; headless runs keep the static figures drawn beside them.

An error in a control's callback would otherwise go to the browser's log console only: each view has an
Output area under its controls where the traceback is shown instead.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence

from opdkit.notebook.figures import sample_html


def reporting(out, fn: Callable) -> Callable:
    """`fn` as a widget callback whose exceptions are printed into the Output widget `out`."""

    def callback(change=None):
        out.outputs = ()
        try:
            fn(change)
        except Exception:
            out.append_stderr(traceback.format_exc())

    return callback


def sample_browser(samples: Sequence[dict], per_page: int = 4):
    """A slider over logged steps showing that step's completions coloured by per-token divergence."""
    import ipywidgets as w

    steps = sorted({s["step"] for s in samples})
    if not steps:
        return w.HTML("<i>no samples logged</i>")
    out = w.HTML()
    vmax = max(max(s["divergence"] + [1e-9]) for s in samples)

    def show(change=None):
        step = steps[slider.value]
        rows = [s for s in samples if s["step"] == step][:per_page]
        out.value = "".join(sample_html(s, vmax) for s in rows)

    slider = w.IntSlider(
        value=len(steps) - 1,
        min=0,
        max=len(steps) - 1,
        description="sample #",
        readout=False,
        continuous_update=False,
    )
    label, errors = w.Label(), w.Output()
    slider.observe(
        reporting(errors, lambda c: (setattr(label, "value", f"step {steps[slider.value]}"), show())),
        names="value",
    )
    label.value = f"step {steps[slider.value]}"
    show()
    return w.VBox([w.HBox([slider, label]), out, errors])


def arm_step_browser(arm_samples: dict[str, Sequence[dict]], per_arm: int = 2):
    """A slider over steps showing every arm's completions at that step, side by side in rows."""
    import ipywidgets as w

    steps = sorted({s["step"] for samples in arm_samples.values() for s in samples})
    if not steps:
        return w.HTML("<i>no samples logged</i>")
    vmax = max(max(s["divergence"] + [1e-9]) for samples in arm_samples.values() for s in samples)
    out = w.HTML()
    slider = w.SelectionSlider(options=steps, value=steps[0], description="step", continuous_update=False)

    def show(change=None):
        parts = []
        for name, samples in arm_samples.items():
            rows = [s for s in samples if s["step"] == slider.value][:per_arm]
            parts.append(
                f"<h4 style='margin:6px 0 0 0'>{name}</h4>" + "".join(sample_html(s, vmax) for s in rows)
            )
        out.value = "".join(parts)

    errors = w.Output()
    slider.observe(reporting(errors, show), names="value")
    show()
    return w.VBox([slider, out, errors])
