"""Every notebook in JupyterLab 4, driven by headless Chromium as a person would use it.

A JupyterLab server on a free localhost port serves copies of the notebooks; Debian's `chromium` (apt) is
driven through the `playwright` package with `executable_path` (no browser download). Each notebook opens
in a fresh workspace, gets a shortened parameters cell, runs all its cells and must show no error, and
what a reader sees must be readable (`check_reader_view`): no cell past JupyterLab's 50 shown outputs (no
"Show more outputs"), the run cell's summary table visible, no "Error displaying widget", and the main
figure shown at no less than 80 % of its size (its smallest text, 9 pt at 100 dpi, stays >= 10 px). In 02
the sample browser's slider must change the shown sample; in 01 an edited parameter must reach the
resolved config when all cells run again in the same kernel; 02 and 03, saved and reopened in a fresh
workspace, must show no widget error either. Screenshots, the main figures among them, go to the test's
temporary folder (`--basetemp` keeps them).
Skipped when chromium or playwright is missing (`.ci/run` installs chromium; playwright is in the dev extra).

Selectors and pitfalls are written down in the helpers; they were found on JupyterLab 4.6 / ipywidgets 8.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
MENUBAR_ITEM, MENU_ITEM = ".lm-MenuBar-itemLabel", ".lm-Menu-itemLabel"
STATUSBAR, CODE_CELL = "#jp-main-statusbar", ".jp-Notebook .jp-CodeCell"
CELL_EDITOR, INPUT_PROMPT = ".jp-InputArea-editor .cm-content", ".jp-InputArea-prompt"
USER_SETTINGS = {
    # no "official Jupyter news?" toast over the page
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
    # render every cell: with the default windowing, off-screen cells have an empty innerText
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
}

NOTEBOOKS = {"savegrad": "01_save_grad", "whitebox": "02_whitebox", "cliplesson": "03_clip_vs_noclip"}
NOTEBOOKS["antidistill"] = "04_antidistill"
NOTEBOOKS["tooluse"] = "05_tool_use"  # the whitebox job on a tool environment
# The cell that runs the job (its summary table last), and the cell with the notebook's main figure.
RUN_CELLS = {
    "savegrad": "savegrad.run(",
    "whitebox": "whitebox.run(",
    "cliplesson": "cliplesson.run(",
    "antidistill": "antidistill.run(",
    "tooluse": "whitebox.run(",
}
MAIN_FIGURES = {"whitebox": "report.curves(run)", "cliplesson": "report.curves(lesson)"}
MAIN_FIGURES["antidistill"] = "report.tradeoff(run)"
MAIN_FIGURES["tooluse"] = "tooluse.bars(run)"
SHOWN_OUTPUTS = 50  # JupyterLab's maxNumberOutputs: past it, "Show more outputs"
# Shortened runs, by job: (name, value) set in the parameters cell, replacing its line or appended.
SHORT = {
    "savegrad": {"subset_size": 8},
    "whitebox": {"max_steps": 20, "eval_size": 20, "eval_every": 10, "eval_every_size": 10},
    "cliplesson": {"arm_max_steps": 4, "ablations": False, "sgd_arms": False, "arm_eval_size": 10},
    "antidistill": {
        "lams": [0.0, 0.1],
        "answer_lams": [],
        "temperatures": [1.5],
        "subset_size": 32,
        "eval_size": 10,
        "sft_max_steps": 3,
    },
    # the student that already calls the calculator, so that the transcripts have tool turns to set apart
    "tooluse": {
        "max_steps": 4,
        "eval_size": 10,
        "eval_every": 2,
        "eval_every_size": 10,
        "student_model": "tiny:teacher-tools",
        "sample_every": 2,
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(tmp: Path, env_extra: dict | None = None):
    """A JupyterLab server whose root holds copies of the notebooks; yields (base URL, root)."""
    root = tmp / "lab"
    shutil.copytree(
        ROOT / "notebooks", root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints")
    )
    for plugin, values in USER_SETTINGS.items():
        ext, name = plugin.split(":")
        path = tmp / "settings" / ext / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OPDKIT_RUNS": str(tmp / "runs"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        **(env_extra or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.ip=127.0.0.1",
        "--ServerApp.allow_root=True",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        f"--LabApp.user_settings_dir={tmp / 'settings'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    log = open(tmp / "jupyter.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"jupyter lab exited {proc.returncode}: {(tmp / 'jupyter.log').read_text()}"
                )
            try:
                urllib.request.urlopen(f"{base}/api/status", timeout=2).read()
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.3)
        yield base, root
    finally:
        proc.terminate()  # the server we started; it shuts its kernels down
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@contextlib.contextmanager
def browser_page(executable: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            yield page
        finally:
            browser.close()


def kernel_status(page) -> str:
    """'Idle', 'Busy', ... from the status bar's 'Python 3 (ipykernel) | Idle'."""
    m = re.search(r"\|\s*(\w[\w ]*)", page.locator(STATUSBAR).inner_text())
    return m.group(1).strip() if m else "?"


def wait_until(page, cond, timeout: float, what: str, poll: float = 0.25) -> None:
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout:
            raise TimeoutError(
                f"{what}: not within {timeout}s (status bar: {page.locator(STATUSBAR).inner_text()!r})"
            )
        page.wait_for_timeout(poll * 1000)


def open_notebook(page, base: str, path: str) -> None:
    """In a fresh workspace (`?reset`: no restored tabs), until the kernel is idle."""
    page.goto(f"{base}/lab/workspaces/{uuid.uuid4().hex[:8]}/tree/{path}?reset")
    page.locator(CODE_CELL).first.wait_for()
    wait_until(page, lambda: kernel_status(page) == "Idle", 120, f"kernel idle after opening {path}")


def menu(page, top: str, item: str) -> None:
    """Anchored labels: 'Run' also matches 'Run All Cells'."""
    page.locator(MENUBAR_ITEM).filter(has_text=re.compile(f"^{re.escape(top)}$")).click()
    page.locator(MENU_ITEM).filter(has_text=re.compile(f"^{re.escape(item)}$")).click()


def busy(page) -> bool:
    prompts = page.locator(f"{CODE_CELL} {INPUT_PROMPT}").all_inner_texts()
    return kernel_status(page) != "Idle" or any("*" in p for p in prompts)


def run_all(page, timeout: float, while_busy=None) -> float:
    """Run > Run All Cells; wait for busy, then for idle with no [*] prompt left (for 1 s: Idle flickers
    between queued cells). `while_busy(page)` runs once the kernel is busy. Returns the seconds it took."""
    t0 = time.time()
    menu(page, "Run", "Run All Cells")
    with contextlib.suppress(TimeoutError):  # a run faster than the poll shows no busy state
        wait_until(page, lambda: busy(page), 15, "busy after Run All", poll=0.05)
    if while_busy:
        while_busy(page)
    wait_until(page, lambda: not busy(page), timeout, "idle after Run All")
    page.wait_for_timeout(1000)
    wait_until(page, lambda: not busy(page), timeout, "idle after Run All (confirmed)")
    return time.time() - t0 - 1.0


def set_parameters(page, values: dict) -> str:
    """Rewrite the parameters cell (the first code cell): replace each named line, append the others."""
    editor = page.locator(CODE_CELL).first.locator(CELL_EDITOR)
    source = editor.inner_text()
    for name, value in values.items():
        line = f"{name}: {type(value).__name__} = {value!r}  # shortened by the browser test"
        source, n = re.subn(rf"^{name}:.*$", line, source, count=1, flags=re.M)
        if not n:
            source += "\n" + line
    editor.click()
    page.keyboard.press("ControlOrMeta+a")
    page.keyboard.insert_text(source)  # one input event: no auto-indent or auto-closed brackets
    page.keyboard.press("Escape")
    return source


def saved_errors(page, base: str, path: str) -> list[dict]:
    """Error outputs, exactly: save the notebook, read it back through the contents API once the save's PUT
    has answered. (In the DOM an exception renders like any stderr output.) Never read during a save:
    jupyter_server writes a notebook in place beside a backup copy, and a read that meets the half-written
    file restores the backup over it, so the save fails (404) and the read too (500); the dirty mark alone
    does not say the save is over (a notebook saved a second time was never dirty)."""
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    url = f"/api/contents/{path}"
    with page.expect_response(lambda r: r.request.method == "PUT" and url in r.url, timeout=30_000) as put:
        page.keyboard.press("ControlOrMeta+s")
    assert put.value.ok, f"saving {path}: {put.value.status}"
    wait_until(page, lambda: page.locator(".jp-mod-current.jp-mod-dirty").count() == 0, 30, "notebook saved")
    nb = json.load(urllib.request.urlopen(f"{base}/api/contents/{path}?content=1"))["content"]
    return [
        {"ename": o["ename"], "evalue": o["evalue"][:500]}
        for c in nb["cells"]
        if c["cell_type"] == "code"
        for o in c.get("outputs", [])
        if o["output_type"] == "error"
    ]


def newest_config(runs: Path, job: str) -> dict:
    newest = max((runs / job).iterdir(), key=lambda p: p.stat().st_mtime)
    return yaml.safe_load((newest / "config.yaml").read_text())


def live_figure_while_training(shots: Path):
    """02's training cell shows the curves (an image) and a progress line before the run is over."""

    def watch(page):
        cell = page.locator(CODE_CELL).filter(has_text="whitebox.run(")
        wait_until(page, lambda: cell.locator(".jp-OutputArea-output img").count() == 1, 240, "a live figure")
        running = "*" in cell.locator(INPUT_PROMPT).inner_text()
        cell.scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "02_live_figure.png"), full_page=False)
        assert running, "the figure came only after training"
        # the progress line, as text: it may come a moment after the figure (its updates are throttled)
        progress = lambda: re.search(r"training .*%\|", cell.locator(".jp-OutputArea").inner_text())  # noqa: E731
        wait_until(page, progress, 60, "the training progress line")
        assert cell.locator(".widget-hprogress, .jupyter-widgets").count() == 0, "no widget"

    return watch


def cell_with(page, needle: str):
    return page.locator(CODE_CELL).filter(has_text=needle).first


def check_reader_view(page, name: str, shots: Path) -> None:
    """What a reader sees after Run All: every cell within JupyterLab's 50 shown outputs, the run cell's
    summary table visible (not behind "Show more outputs"), no widget error; the main figure shown at no
    less than 80 % of its drawn size, screenshot in `shots`."""
    assert page.get_by_text("Show more outputs").count() == 0
    for i, cell in enumerate(page.locator(CODE_CELL).all()):
        shown = cell.locator(".jp-OutputArea-child").count()
        assert shown <= SHOWN_OUTPUTS, f"{name} cell {i}: {shown} outputs"
    assert page.get_by_text("Error displaying widget").count() == 0, name
    table = cell_with(page, RUN_CELLS[name]).locator(".jp-OutputArea-output table").last
    table.scroll_into_view_if_needed()
    assert table.is_visible(), f"{name}: the run cell's summary table"
    if name in MAIN_FIGURES:
        img = cell_with(page, MAIN_FIGURES[name]).locator(".jp-OutputArea-output img").first
        img.scroll_into_view_if_needed()
        scale = img.evaluate("i => i.clientWidth / i.naturalWidth")
        assert scale >= 0.8, f"{name}: the main figure is shown at {scale:.0%} of its size"
        img.screenshot(path=str(shots / f"{NOTEBOOKS[name]}_main_figure.png"))


def reopened_without_widget_errors(page, base: str, path: str) -> None:
    """The saved notebook in a fresh workspace, its kernel gone: no output may read 'Error displaying
    widget' (a widget output whose model went with the kernel)."""
    open_notebook(page, base, path)
    page.wait_for_timeout(3000)  # the widget manager gives up on a missing model after 2 s
    assert page.get_by_text("Error displaying widget").count() == 0, path


def move_slider_and_read(page) -> tuple[tuple[str, str], tuple[str, str]]:
    """02's sample browser (an HTML pager): the slider starts at the last logged step; Home goes to the
    first."""
    pager = cell_with(page, "report.sample_browser(run)").locator(".opdkit-pager")
    slider = pager.locator("input[type=range]")
    slider.scroll_into_view_if_needed()
    label, shown = pager.locator(".opdkit-pager-label"), pager.locator(".opdkit-page")
    before = (label.inner_text(), shown.inner_text())
    slider.focus()
    page.keyboard.press("Home")
    wait_until(page, lambda: label.inner_text() != before[0], 20, "the slider's step label changes")
    return before, (label.inner_text(), shown.inner_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_notebook_in_jupyterlab(tmp_path):
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on PATH: apt-get install -y chromium")
    runs = tmp_path / "runs"
    shots = tmp_path / "screenshots"
    shots.mkdir()
    timings = {}
    with jupyter_lab(tmp_path) as (base, _root), browser_page(chromium) as page:
        for name, short in SHORT.items():
            path = f"notebooks/{NOTEBOOKS[name]}.ipynb"
            open_notebook(page, base, path)
            if name == "antidistill":  # the gradient of the 01 run above, instead of a new one
                short = {
                    **short,
                    "grads_run": str(max((runs / "savegrad").iterdir(), key=os.path.getmtime)),
                }
            set_parameters(page, short)
            timings[name] = run_all(
                page, 420, live_figure_while_training(shots) if name == "whitebox" else None
            )
            page.screenshot(path=str(shots / f"{name}.png"), full_page=False)
            assert saved_errors(page, base, path) == [], name
            check_reader_view(page, name, shots)
            if name == "savegrad":  # edit a value, Run All again in the same kernel
                assert newest_config(runs, name)["subset_size"] == 8
                set_parameters(page, {"subset_size": 6})
                timings[name + " again"] = run_all(page, 420)
                assert saved_errors(page, base, path) == []
                assert newest_config(runs, name)["subset_size"] == 6
            if name == "whitebox":
                before, after = move_slider_and_read(page)
                page.screenshot(path=str(shots / "02_slider_moved.png"), full_page=False)
                assert before[0] == "step 20" and after[0] == "step 10" and before[1] != after[1]
                evals = [r for r in _records(runs / name) if "eval_accuracy" in r]
                assert [r["step"] for r in evals] == [10, 20]
            if name == "tooluse":  # the transcript view: the student's turns and, set apart, the tool's
                view = cell_with(page, "tooluse.transcripts(run").locator(".jp-OutputArea-output").first
                view.scroll_into_view_if_needed()
                text = view.inner_text()
                assert text.count("student") >= 2 and "tool / template" in text and "tool_response" in text
                page.screenshot(path=str(shots / "05_transcripts.png"), full_page=False)
            if name in ("whitebox", "cliplesson"):  # no widget at all: nothing to lose with the kernel
                saved_errors(page, base, path)  # saves it
                reopened_without_widget_errors(page, base, path)
    print("Run All Cells seconds:", json.dumps({k: round(v, 1) for k, v in timings.items()}))


def _records(job_runs: Path) -> list[dict]:
    newest = max(job_runs.iterdir(), key=os.path.getmtime)
    return [json.loads(line) for line in (newest / "metrics.jsonl").read_text().splitlines()]
