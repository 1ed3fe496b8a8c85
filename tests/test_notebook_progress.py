"""Progress bars in a notebook kernel: one text display per cell, updated in place, in a real kernel too (no
widget output, whatever tqdm.auto bar the kit or transformers makes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tqdm import std

from opdkit.notebook import progress
from opdkit.run.lifecycle import RunFailed

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


class FakeHandle:
    def __init__(self, shown: list):
        self.shown = shown

    def update(self, data, raw=False):
        self.shown[-1] = data["text/plain"]


@pytest.fixture
def displays(monkeypatch):
    """Every display the board makes (one entry each, updated in place), in a cell numbered by `cell[0]`."""
    import IPython.display

    shown, cell = [], [1]

    def display(data, raw=False, display_id=False):
        shown.append(data["text/plain"])
        return FakeHandle(shown)

    monkeypatch.setattr(IPython.display, "display", display)
    monkeypatch.setattr(progress, "BOARD", progress.Board(every_s=0.0))
    monkeypatch.setattr(progress.Board, "_current_cell", lambda self: cell[0])
    return shown, cell


def test_every_bar_of_a_cell_is_a_line_of_one_display(displays):
    shown, cell = displays
    for _ in progress.CellBar(range(3), desc="traces"):
        pass
    with progress.CellBar(total=4, desc="training", mininterval=0) as bar:
        bar.update(2)
        assert len(shown) == 1 and "traces: 100%" in shown[0] and "training:  50%" in shown[0]
    first, second = shown[0].splitlines()
    assert first.startswith("traces: 100%") and second.startswith("training:  50%")  # closed where it was
    cell[0] = 2  # the next cell: its own display
    for _ in progress.CellBar(range(2), desc="eval", leave=False):
        pass
    assert len(shown) == 2 and shown[1] == ""  # a bar that does not stay leaves no line once done
    cell[0] = 3
    progress.BOARD.draw()  # nothing to show yet: no empty display
    assert len(shown) == 2


def test_only_the_last_finished_bars_stay_listed(displays):
    shown, _ = displays
    for k in range(progress.KEEP + 3):
        for _ in progress.CellBar(range(1), desc=f"point {k}"):
            pass
    lines = shown[0].splitlines()
    assert lines[0] == "... 3 earlier bar(s) finished" and len(lines) == progress.KEEP + 1
    assert lines[-1].startswith(f"point {progress.KEEP + 2}:")


class RecordingShell:
    """IPython's `showtraceback`, as far as a known failure goes: the exception's `_render_traceback_`; it
    records what was shown, with the bars still open and the progress display at that moment."""

    def __init__(self, shown: list):
        self.shown, self.calls = shown, []

    def showtraceback(self, exc_tuple, tb_offset=None):
        open_bars = [b.desc for b in std.tqdm._instances]
        self.calls.append((exc_tuple[1]._render_traceback_(), open_bars, self.shown[-1]))


def test_a_known_failure_closes_the_open_bars_then_shows_one_line(displays):
    """What IPython calls for a `RunFailure` raised in a cell (`install` registers it): the open bar is closed
    (its line stays where it stopped), then the failure is its one `error:` line, as on the command line."""
    shown, _ = displays
    shell = RecordingShell(shown)
    bar = progress.CellBar(total=10, desc="training", mininterval=0)
    bar.update(3)
    try:
        raise RunFailed("the teacher's server died\n: start it again; resume=true continues")
    except RunFailed as exc:
        progress.show_failure(shell, type(exc), exc, exc.__traceback__)
    [(lines, open_bars, board)] = shell.calls
    assert lines == ["error: the teacher's server died : start it again; resume=true continues"]
    assert open_bars == [] and bar not in std.tqdm._instances
    assert board.startswith("training:  30%") and board.count("\n") == 0
    assert progress.BOARD.running == {}  # nothing left to redraw in a later cell


def test_install_swaps_tqdm_auto_only_in_a_kernel_and_only_before_its_import():
    code = textwrap.dedent(
        """
        import sys, types
        sys.modules["ipykernel.zmqshell"] = types.ModuleType("ipykernel.zmqshell")  # stands for a kernel
        from opdkit.notebook import progress
        first = progress.install()
        from tqdm.auto import tqdm
        from transformers.trainer_callback import ProgressCallback  # imports tqdm.auto after the swap
        import transformers.trainer_callback as tc
        bars = issubclass(tqdm, progress.CellBar), issubclass(tc.tqdm, progress.CellBar)
        print(first, progress.install(), *bars)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True", "True"]
    late = "import tqdm.auto\nfrom opdkit.notebook import progress\nprint(progress.install())"
    outside = subprocess.run([sys.executable, "-c", late], capture_output=True, text=True, check=True).stdout
    assert outside.strip() == "False"  # no kernel here, and tqdm.auto already imported


@pytest.mark.timeout(300)
def test_a_kernel_run_cell_holds_one_text_display_and_no_widget(tmp_path):
    """A real kernel (nbclient, as papermill): the kit's bars and transformers' through tqdm.auto; a known
    failure with a bar open is one line, the bar closed by then."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from opdkit.notebook import progress\nprogress.install()  # first, as every notebook\n"
            "from opdkit.jobs import whitebox"
        ),
        nbformat.v4.new_code_cell(
            "from tqdm.auto import tqdm\nfrom transformers.trainer_callback import tqdm as hf_tqdm\n"
            "for _ in tqdm(range(50), desc='kit'): pass\n"
            "for _ in hf_tqdm(range(30), desc='transformers'): pass\n"
            "print('done')"
        ),
        nbformat.v4.new_code_cell(
            "from opdkit.run.lifecycle import RunFailed\n"
            "bar = tqdm(total=10, desc='training')\nbar.update(3)\n"
            "raise RunFailed('the teacher died; resume=true continues')"
        ),
        nbformat.v4.new_code_cell("print('open bars:', len(tqdm._instances))"),
    ]
    NotebookClient(nb, kernel_name="python3", timeout=240, allow_errors=True).execute()
    failed = nb.cells[2].outputs
    assert [o["output_type"] for o in failed] == ["display_data", "error"], failed
    assert failed[1]["traceback"] == ["error: the teacher died; resume=true continues"]
    assert nb.cells[3].outputs[0]["text"] == "open bars: 0\n"
    outputs = nb.cells[1].outputs
    displays = [o for o in outputs if o["output_type"] == "display_data"]
    assert len(displays) == 1 and set(displays[0]["data"]) == {"text/plain"}
    text = displays[0]["data"]["text/plain"]
    assert "kit: 100%" in text and "transformers: 100%" in text
    assert "application/vnd.jupyter.widget-view+json" not in json.dumps(outputs)
    assert len(outputs) <= 3  # the display and the print


def test_every_notebook_installs_the_cell_bars_before_it_imports_anything():
    """Importing a job installs nothing (`opdkit.jobs`): each notebook's first cell that imports calls
    `progress.install()` first (its job's report imports transformers, and so tqdm.auto)."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        first = next(c for c in cells if c["cell_type"] == "code" and "import" in "".join(c["source"]))
        lines = [line for line in "".join(first["source"]).splitlines() if line.strip()]
        assert lines[0] == "from opdkit.notebook import progress", path.name
        assert lines[1].startswith("progress.install()"), path.name
