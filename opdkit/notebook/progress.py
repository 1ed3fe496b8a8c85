"""Progress bars in a notebook kernel: every bar of a cell is one line of text in one display, updated in
place, instead of an ipywidget per bar.

    progress.install()        # before anything imports tqdm.auto: a notebook's first cell, first

In a kernel, tqdm.auto draws each bar as an ipywidget. A headless run (papermill) saves them as widget
outputs that read "Error displaying widget: model not found" when the notebook is reopened (a JupyterLab run
too, unless it saves widget state), and each bar is one more output of its cell, where JupyterLab shows the
first 50 and hides the rest, the cell's summary table among them. Here tqdm.auto's bar is `CellBar`: a text
bar whose line lives in the cell's one progress display (`Board`), redrawn at most every `every_s` seconds
and when a bar finishes; the last `KEEP` finished bars stay listed. Bars made before `install` (a package
imported earlier in the kernel) stay widgets.

A failure the kit knows (`ConfigError`, `RunFailure`) is shown as its one line (its `_render_traceback_`), as
on the command line: `install` has IPython close the open bars first (`show_failure`), so that no bar is left
running above the line, nor drawn into a later cell when it is closed at last.

Pitfalls: tqdm picks its notebook bar when `tqdm.auto` is first imported (transformers imports it), so
`install` must run first; tqdm's monitor thread would redraw from another thread, whose display could land in
another cell, so `CellBar` has none.
"""

from __future__ import annotations

import sys
import time
import warnings

from tqdm import std

from opdkit.config import ConfigError, RunFailure
from opdkit.run.cli import close_progress_bars

KEEP = 8  # finished bars listed under the running ones


def in_jupyter_kernel() -> bool:
    """A Jupyter kernel (JupyterLab, papermill, nbclient): where tqdm.auto would draw widgets."""
    return "ipykernel.zmqshell" in sys.modules


class Board:
    """The current cell's progress display: one line per bar, running ones first, then the last `KEEP`
    finished ones."""

    def __init__(self, every_s: float = 1.0):
        self.every_s, self.cell, self.handle = every_s, None, None
        self.running: dict[int, str] = {}
        self.finished: list[str] = []
        self.drawn_at = 0.0

    def _current_cell(self) -> object:
        from IPython import get_ipython

        shell = get_ipython()
        return None if shell is None else shell.execution_count

    def show(self, bar: object, text: str, done: bool = False) -> None:
        cell = self._current_cell()
        if cell != self.cell:  # a new cell: a new display there
            self.cell, self.handle, self.running, self.finished = cell, None, {}, []
        if done:
            self.running.pop(id(bar), None)
            if text:
                self.finished.append(text)
        else:
            self.running[id(bar)] = text
        if done or time.monotonic() - self.drawn_at >= self.every_s:
            self.draw()

    def text(self) -> str:
        earlier = len(self.finished) - KEEP
        head = [f"... {earlier} earlier bar(s) finished"] if earlier > 0 else []
        return "\n".join(head + self.finished[-KEEP:] + [t for t in self.running.values() if t])

    def draw(self) -> None:
        from IPython.display import display

        data = {"text/plain": self.text()}
        if self.handle is None and not data["text/plain"]:
            return  # no display until a bar has a line to show
        if self.handle is None:
            self.handle = display(data, raw=True, display_id=True)
        else:
            self.handle.update(data, raw=True)
        self.drawn_at = time.monotonic()


BOARD = Board()


class _Discard:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class CellBar(std.tqdm):
    """tqdm's text bar, drawn as a line of the cell's progress display (`BOARD`) instead of on a stream."""

    monitor_interval = 0  # no monitor thread: every redraw comes from the cell's own thread

    def __init__(self, *args, **kwargs):
        kwargs["file"] = _Discard()
        kwargs.setdefault("ncols", 100)
        kwargs.setdefault("ascii", False)  # the display is unicode, whatever the discarded stream says
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        BOARD.show(self, self.__str__() if msg is None else msg)
        return True

    def close(self) -> None:
        if getattr(self, "disable", True):
            return
        super().close()
        BOARD.show(self, self.__str__() if self.leave is not False else "", done=True)


def cell_trange(*args, **kwargs) -> CellBar:
    return CellBar(range(*args), **kwargs)


def show_failure(shell, etype: type, value: BaseException, tb, tb_offset: int | None = None) -> None:
    """IPython's handler of the kit's known failures (`shell.set_custom_exc`): the open bars closed, then the
    failure shown as IPython shows any error, which for these is their one line."""
    close_progress_bars()
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)


def install() -> bool:
    """In a Jupyter kernel, make tqdm.auto's bar `CellBar`, before anything imports tqdm.auto, and a known
    failure close the open bars before its line (`show_failure`). True when tqdm.auto's bar is `CellBar` (now
    or from an earlier call); False elsewhere, or when tqdm.auto was imported first (too late: its users hold
    the widget bar)."""
    if in_jupyter_kernel():
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.set_custom_exc((ConfigError, RunFailure), show_failure)
    if "tqdm.auto" in sys.modules:
        return issubclass(sys.modules["tqdm.auto"].tqdm, CellBar)
    if not in_jupyter_kernel():
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tqdm's "Using `tqdm.autonotebook.tqdm` in notebook mode"
        import tqdm.autonotebook as chosen
    chosen.tqdm, chosen.trange = CellBar, cell_trange
    return True
