"""What a run shows while it trains: a live figure in JupyterLab, plain logs everywhere else.

    notebook_view(trainer, max_grad_norm=1.0, title="whitebox · tiny")   # after building a Trainer

In a notebook kernel transformers shows a step table that grows to hundreds of rows. `notebook_view`
removes it. In JupyterLab (a kernel started by a Jupyter server, which sets `JPY_SESSION_NAME`) it adds
`LiveTraining`: a progress bar and the training curves (loss, pre-clip gradient norm, held-out accuracy
when measured) redrawn every few seconds in one display. Headless (papermill, nbclient) it adds
transformers' plain `ProgressCallback`, whose logs land in the executed notebook; the report cells draw
the static figures there. `OPDKIT_LIVE=1` / `0` forces the choice. Only a single in-process run shows a
live view: processes forked by `notebook_launcher` cannot update the notebook's displays.

(A run with `dry_run` stops after its memory plan by raising `run.lifecycle.PlanOnly` in a kernel.)
"""

from __future__ import annotations

import io
import os
import time

from transformers import ProgressCallback, TrainerCallback

from opdkit.run.lifecycle import in_kernel

LIVE_ENV = "OPDKIT_LIVE"


def live_wanted() -> bool:
    """A live view: in a kernel that a Jupyter server started (a person is watching), unless OPDKIT_LIVE
    says."""
    forced = os.environ.get(LIVE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return in_kernel() and "JPY_SESSION_NAME" in os.environ


def notebook_view(trainer, **figure) -> None:
    """Swap transformers' notebook table for the live view (JupyterLab) or plain logs (headless);
    nothing changes outside a kernel or in a multi-process run."""
    if not in_kernel() or trainer.args.world_size > 1:
        return
    from transformers.utils.notebook import NotebookProgressCallback

    trainer.remove_callback(NotebookProgressCallback)
    if trainer.args.disable_tqdm:
        return
    trainer.add_callback(LiveTraining(**figure) if live_wanted() else ProgressCallback())


class LiveTraining(TrainerCallback):
    """A progress bar and the training curves, redrawn at the end and in between at most every `every_s`
    seconds, and never more often than keeps drawing under `max_share` of the time (a redraw costs
    ~0.2-0.5 s of the same CPU that trains)."""

    def __init__(
        self,
        max_grad_norm: float | None = None,
        title: str = "",
        every_s: float = 5.0,
        max_share: float = 0.03,
    ):
        self.max_grad_norm, self.title, self.every_s, self.max_share = (
            max_grad_norm,
            title,
            every_s,
            max_share,
        )
        self.records: list[dict] = []
        self.bar = self.handle = None
        self.drawn_at, self.draw_s = 0.0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        from IPython.display import HTML, display
        from tqdm.auto import tqdm

        self.bar = tqdm(total=state.max_steps, desc="training", initial=state.global_step)
        self.handle = display(HTML("<i>the curves appear after the first logged step</i>"), display_id=True)
        self.records, self.drawn_at = [], 0.0

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        keep = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
        if "loss" in keep or "eval_accuracy" in keep:
            self.records.append({"step": state.global_step, **keep})
            if self.bar is not None and "loss" in keep:
                self.bar.set_postfix(
                    loss=f"{keep['loss']:.3g}", grad_norm=f"{keep.get('grad_norm', float('nan')):.3g}"
                )
        if time.monotonic() - self.drawn_at >= max(self.every_s, self.draw_s / self.max_share):
            self.draw()

    def on_train_end(self, args, state, control, **kwargs):
        self.draw()
        if self.bar is not None:
            self.bar.close()

    def draw(self) -> None:
        if self.handle is None or not self.records:
            return
        t0 = time.monotonic()
        from IPython.display import Image
        from matplotlib.figure import Figure

        from opdkit.notebook.figures import CURVE_PANELS, draw_training_curves

        panels = len(CURVE_PANELS) + any("eval_accuracy" in r for r in self.records)
        fig = Figure(figsize=(3.2 * panels, 2.6))  # not pyplot's: the cell must not show it again at its end
        draw_training_curves(self.records, self.max_grad_norm, self.title, fig=fig)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80)
        self.handle.update(Image(png.getvalue()))
        self.drawn_at = time.monotonic()
        self.draw_s = self.drawn_at - t0
