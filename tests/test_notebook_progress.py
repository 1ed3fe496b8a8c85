"""Progress bars in a notebook kernel: one text display per cell, updated in place, in a real kernel too (no
widget output, whatever tqdm.auto bar the kit or transformers makes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from opdkit.notebook import progress


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
    """A real kernel (nbclient, as papermill): the kit's bars and transformers' through tqdm.auto."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("from opdkit.jobs import whitebox  # installs the cell bars first"),
        nbformat.v4.new_code_cell(
            "from tqdm.auto import tqdm\nfrom transformers.trainer_callback import tqdm as hf_tqdm\n"
            "for _ in tqdm(range(50), desc='kit'): pass\n"
            "for _ in hf_tqdm(range(30), desc='transformers'): pass\n"
            "print('done')"
        ),
    ]
    NotebookClient(nb, kernel_name="python3", timeout=240).execute()
    outputs = nb.cells[1].outputs
    displays = [o for o in outputs if o["output_type"] == "display_data"]
    assert len(displays) == 1 and set(displays[0]["data"]) == {"text/plain"}
    text = displays[0]["data"]["text/plain"]
    assert "kit: 100%" in text and "transformers: 100%" in text
    assert "application/vnd.jupyter.widget-view+json" not in json.dumps(outputs)
    assert len(outputs) <= 3  # the display and the print
