"""What a finished whitebox run shows: its curves, accuracies and sampled completions.

curves(run); accuracy(run); html, fig = samples(run)          # each figure saved under figures/
sample_browser(run)                                          # JupyterLab: page through the samples
"""

from __future__ import annotations

from opdkit.notebook import figures as run_figures
from opdkit.notebook import widgets
from opdkit.run.folders import RunDir


def curves(run: RunDir):
    """Loss, pre-clip gradient norm (with the clip threshold), completion length and entropy per step."""
    config = run.read_config()
    return run_figures.training_curves(
        run, max_grad_norm=config.get("max_grad_norm"), title=f"whitebox · {config.get('mode', '')}"
    )


def accuracy(run: RunDir):
    """Student before and after distillation, and the teacher, on the held-out problems."""
    return run_figures.accuracy_bars(run, run.read_summary())


def samples(run: RunDir, n: int = 6) -> tuple[str, object]:
    """The last `n` logged completions coloured by per-token divergence: (HTML, static figure)."""
    shown = run.read_jsonl("samples.jsonl")[-n:]
    return run_figures.samples_html(shown), run_figures.samples_figure(shown, path=run.figure("samples"))


def sample_browser(run: RunDir):
    """A widget paging through every logged completion (JupyterLab; headless runs keep `samples`)."""
    return widgets.sample_browser(run.read_jsonl("samples.jsonl"))


def figures(run: RunDir) -> None:
    """Every figure of the run, as a headless run keeps them."""
    curves(run)
    accuracy(run)
    samples(run)
