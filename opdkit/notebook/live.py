"""What a run shows while it trains: a live figure in JupyterLab, a progress line everywhere else.

    notebook_view(trainer, max_grad_norm=1.0, title="whitebox · tiny", reference={"teacher_accuracy": 0.99})
    notebook_view(trainer, live=False)           # any other Trainer the kit builds in a kernel: its bar only

In a notebook kernel transformers shows a step table that grows to hundreds of rows (its
`NotebookProgressCallback`, which is not a `ProgressCallback`), or with `ProgressCallback` prints a dict per
logged step. `notebook_view` replaces either: in JupyterLab (a kernel started by a Jupyter server, which
sets `JPY_SESSION_NAME`) with `LiveTraining`, a progress line and the training curves (loss, pre-clip
gradient norm, held-out accuracy when measured, the teacher's accuracy on it) redrawn every few seconds in one
display; headless (papermill, nbclient) with `TrainingBar`, the progress line alone, its postfix the last
loss and gradient norm. The lines are the cell's progress display (`notebook.progress`), not widgets.
`OPDKIT_LIVE=1` / `0` forces the choice. Only a single in-process run shows a view: processes forked by
`notebook_launcher` cannot update the notebook's displays.

(A run with `dry_run` stops after its memory plan by raising `run.lifecycle.PlanOnly` in a kernel.)
"""

from __future__ import annotations

import io
import os
import time

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from opdkit.run.lifecycle import in_kernel

LIVE_ENV = "OPDKIT_LIVE"


def live_wanted() -> bool:
    """A live view: in a kernel that a Jupyter server started (a person is watching), unless OPDKIT_LIVE
    says."""
    forced = os.environ.get(LIVE_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return in_kernel() and "JPY_SESSION_NAME" in os.environ


def notebook_view(trainer, live: bool = True, **figure) -> None:
    """Swap transformers' notebook table (or printed dicts) for the live view (JupyterLab, with `live`) or a
    progress line; nothing changes outside a kernel or in a multi-process run. `figure`: `LiveTraining`'s
    arguments."""
    if not in_kernel() or trainer.args.world_size > 1:
        return
    from transformers.utils.notebook import NotebookProgressCallback

    for callback in (NotebookProgressCallback, ProgressCallback, PrinterCallback):
        trainer.remove_callback(callback)
    trainer.add_callback(
        LiveTraining(**figure) if live and live_wanted() else TrainingBar(figure.get("title", ""))
    )


class TrainingBar(TrainerCallback):
    """One progress line for the training, its postfix the last logged loss and pre-clip gradient norm."""

    def __init__(self, title: str = ""):
        self.title, self.bar = title, None

    def on_train_begin(self, args, state, control, **kwargs):
        from tqdm.auto import tqdm

        desc = f"training {self.title}".strip()
        self.bar = tqdm(total=state.max_steps, desc=desc, initial=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if self.bar is not None and isinstance(logs.get("loss"), (int, float)):
            norm = logs.get("grad_norm")
            shown = {"loss": f"{logs['loss']:.3g}"}
            if isinstance(norm, (int, float)):
                shown["grad_norm"] = f"{norm:.3g}"
            self.bar.set_postfix(shown, refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


class LiveTraining(TrainingBar):
    """The progress line and the training curves, redrawn at the end and in between at most every `every_s`
    seconds, and never more often than keeps drawing under `max_share` of the time (a redraw costs ~0.2-0.5 s
    of the same CPU that trains). `reference`: the teacher's accuracy and the student's before training, drawn
    on the held-out accuracy panel."""

    def __init__(
        self,
        max_grad_norm: float | None = None,
        title: str = "",
        reference: dict | None = None,
        every_s: float = 5.0,
        max_share: float = 0.03,
    ):
        super().__init__(title)
        self.max_grad_norm, self.reference = max_grad_norm, reference or {}
        self.every_s, self.max_share = every_s, max_share
        self.records: list[dict] = []
        self.handle = None
        self.drawn_at, self.draw_s = 0.0, 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        from IPython.display import HTML, display

        super().on_train_begin(args, state, control, **kwargs)
        self.handle = display(HTML("<i>the curves appear after the first logged step</i>"), display_id=True)
        self.records, self.drawn_at = [], 0.0

    def on_log(self, args, state, control, logs=None, **kwargs):
        super().on_log(args, state, control, logs=logs, **kwargs)
        keep = {k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))}
        if "loss" in keep or "eval_accuracy" in keep:
            self.records.append({"step": state.global_step, **keep})
        if time.monotonic() - self.drawn_at >= max(self.every_s, self.draw_s / self.max_share):
            self.draw()

    def on_train_end(self, args, state, control, **kwargs):
        self.draw()
        super().on_train_end(args, state, control, **kwargs)

    def draw(self) -> None:
        if self.handle is None or not self.records:
            return
        t0 = time.monotonic()
        from IPython.display import Image
        from matplotlib.figure import Figure

        from opdkit.notebook.figures import DISPLAY_DPI, draw_training_curves

        fig = Figure()  # not pyplot's: the cell must not show it again at its end
        draw_training_curves([self.records], self.max_grad_norm, self.title, self.reference, fig=fig)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=DISPLAY_DPI)
        self.handle.update(Image(png.getvalue()))
        self.drawn_at = time.monotonic()
        self.draw_s = self.drawn_at - t0
