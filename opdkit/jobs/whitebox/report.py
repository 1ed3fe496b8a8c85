"""What a finished 02_whitebox run shows: its curves, accuracies and sampled completions.

curves(run); accuracy(run); html, fig = samples(run)          # each figure saved under figures/
"""

from __future__ import annotations

from opdkit import plots
from opdkit.runs import RunDir


def curves(run: RunDir):
    """Loss, pre-clip gradient norm (with the clip threshold), completion length and entropy per step."""
    config = run.read_config()
    return plots.training_curves(
        run, max_grad_norm=config.get("max_grad_norm"), title=f"02_whitebox · {config.get('mode', '')}"
    )


def accuracy(run: RunDir):
    """Student before and after distillation, and the teacher, on the held-out problems."""
    return plots.accuracy_bars(run, run.read_summary())


def samples(run: RunDir, n: int = 6) -> tuple[str, object]:
    """The last `n` logged completions coloured by per-token divergence: (HTML, static figure)."""
    shown = run.read_jsonl("samples.jsonl")[-n:]
    return plots.samples_html(shown), plots.samples_figure(shown, path=run.figure("samples"))


def figures(run: RunDir) -> None:
    """Every figure of the run, as a headless run keeps them."""
    curves(run)
    accuracy(run)
    samples(run)
