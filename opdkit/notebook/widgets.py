"""Views to explore a run in a notebook: `Pager`s (HTML and a slider, no kernel needed) and, for what must
compute as you pick (antidistill's token explorer), ipywidgets where a person is watching.

    display(sample_browser(samples))                  # a slider over logged steps, their completions
    display(arm_step_browser({"clip": [...], ...}))   # one step, every arm side by side

A widget's output is a reference to a model in the kernel: a notebook run headless (papermill) or reopened
after its kernel is gone shows "Error displaying widget: model not found" in its place. A `Pager` is HTML:
every page is in the output, a slider swaps them in the browser (where the notebook is trusted: cells run in
this session, or a notebook saved by its owner); elsewhere scripts are off and its first shown page stays,
a static view. `live_view(make, fallback)` gives a widget only where a person watches (`live.live_wanted`),
else the fallback; and a widget's callback errors are printed into an Output area under its controls (they
would otherwise go to the browser's log console only).
"""

from __future__ import annotations

import html as _html
import json
import traceback
import uuid
from collections.abc import Callable, Sequence

from opdkit.notebook.figures import sample_html
from opdkit.notebook.live import live_wanted


def reporting(out, fn: Callable) -> Callable:
    """`fn` as a widget callback whose exceptions are printed into the Output widget `out`."""

    def callback(change=None):
        out.outputs = ()
        try:
            fn(change)
        except Exception:
            out.append_stderr(traceback.format_exc())

    return callback


def live_view(make: Callable[[], object], fallback: str) -> object:
    """`make()` (an ipywidget) where a person is watching; elsewhere the HTML `fallback`, so that no output
    of a headless run is a widget."""
    if live_wanted():
        return make()
    from IPython.display import HTML

    return HTML(fallback)


# Inline, so that it runs wherever the notebook is trusted, with no script tag to load: the chosen page's
# label and HTML from the pager's JSON.
_SWAP = (
    "var b=this.closest('.opdkit-pager'),"
    "p=JSON.parse(b.querySelector('.opdkit-pages').textContent)[this.value];"
    "b.querySelector('.opdkit-page').innerHTML=p[1];b.querySelector('.opdkit-pager-label').textContent=p[0];"
)


class Pager:
    """Pages of HTML behind a slider, in one HTML output (`_repr_html_`): `pages` are (label, HTML) pairs,
    `start` the page shown first (and the only one where scripts are off)."""

    def __init__(self, pages: Sequence[tuple[str, str]], start: int = 0, name: str = "page"):
        if not pages:
            raise ValueError("a Pager needs at least one page.")
        self.pages, self.start, self.name = list(pages), start % len(pages), name

    def _repr_html_(self) -> str:
        label, page = self.pages[self.start]
        data = json.dumps(self.pages).replace("</", "<\\/")  # no '</script>' inside the script
        uid = uuid.uuid4().hex[:8]
        return (
            f'<div class="opdkit-pager" id="opdkit-pager-{uid}">'
            f'<div><input type="range" min="0" max="{len(self.pages) - 1}" value="{self.start}" '
            f'aria-label="{_html.escape(self.name)}" oninput="{_html.escape(_SWAP)}"> '
            f'<span class="opdkit-pager-label">{_html.escape(label)}</span></div>'
            f'<div class="opdkit-page">{page}</div>'
            f'<script type="application/json" class="opdkit-pages">{data}</script></div>'
        )


def sample_browser(samples: Sequence[dict], per_page: int = 4) -> Pager | NoSamples:
    """A slider over logged steps showing that step's completions coloured by per-token divergence (the last
    step first)."""
    steps = sorted({s["step"] for s in samples})
    if not steps:
        return NoSamples()
    vmax = max(max(s["divergence"] + [1e-9]) for s in samples)
    pages = [
        (
            f"step {step}",
            "".join(sample_html(s, vmax) for s in [s for s in samples if s["step"] == step][:per_page]),
        )
        for step in steps
    ]
    return Pager(pages, start=len(pages) - 1, name="sample step")


def arm_step_browser(arm_samples: dict[str, Sequence[dict]], per_arm: int = 2) -> Pager | NoSamples:
    """A slider over steps showing every arm's completions at that step, one arm under another."""
    steps = sorted({s["step"] for samples in arm_samples.values() for s in samples})
    if not steps:
        return NoSamples()
    vmax = max(max(s["divergence"] + [1e-9]) for samples in arm_samples.values() for s in samples)

    def page(step: int) -> str:
        return "".join(
            f"<h4 style='margin:6px 0 0 0'>{_html.escape(name)}</h4>"
            + "".join(sample_html(s, vmax) for s in [s for s in samples if s["step"] == step][:per_arm])
            for name, samples in arm_samples.items()
        )

    return Pager([(f"step {step}", page(step)) for step in steps], start=0, name="step")


class NoSamples:
    """What a browser shows when the run logged no samples."""

    def _repr_html_(self) -> str:
        return "<i>no samples logged (sample_every = 0, or the run was shorter than one interval)</i>"
