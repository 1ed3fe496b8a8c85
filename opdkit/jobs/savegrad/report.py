"""What a finished savegrad run shows: its traces as the proxy read them, their lengths, and the saved
gradient's norm per layer and per tensor.

    display(HTML(summary_table_html(summary))); print(show_traces(run, n=4)); length_histogram(run)
    layer_norm_bars(run); largest_tensors(run)
"""

from __future__ import annotations

from opdkit.ads import gradfile, gradient
from opdkit.data.traces import format_trace, load_traces
from opdkit.models import load_tokenizer, model_skeleton
from opdkit.notebook import verdicts
from opdkit.notebook.figures import plt
from opdkit.run.folders import RunDir


def summary_table_html(summary: dict) -> str:
    """The run at a glance: traces, the teacher's accuracy on them, the proxy's loss and the gradient's norm
    (accuracies in percent)."""
    rows = [
        ("traces", f"{summary.get('num_traces')} ({summary.get('truncated_traces', 0)} truncated)"),
        ("teacher accuracy on them", verdicts.pct(summary.get("teacher_accuracy"))),
        ("completion tokens, mean per trace", f"{summary.get('mean_completion_tokens', float('nan')):.1f}"),
        (
            f"proxy loss ({summary.get('normalization')} mean), nats/token",
            f"{summary.get('proxy_loss', float('nan')):.4f}",
        ),
        ("gradient taken on", _taken_on(summary)),
        ("gradient norm", f"{summary.get('grad_norm', float('nan')):.4g}"),
        ("status", str(summary.get("status"))),
    ]
    body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _taken_on(summary: dict) -> str:
    """Which completion tokens the gradient is taken on (`grad_tokens`) and how many of them."""
    tokens = summary.get("grad_tokens", "all")
    if tokens == "all" or summary.get("gradient_tokens") is None:
        return f"{tokens}: every completion token"
    return (
        f"{tokens}: {summary['gradient_tokens']} of {summary.get('completion_tokens')} completion tokens, "
        f"in {summary.get('gradient_traces')} traces"
    )


def show_traces(run: RunDir, n: int = 4) -> str:
    """The first `n` traces of a run: answer, correctness, completion length and the tokens themselves."""
    ds = load_traces(run)
    tok = load_tokenizer(run.read_config()["proxy_model"])
    blocks = []
    for i, row in enumerate(ds.select(range(min(n, len(ds))))):
        head = (
            f"trace {i} · answer {row['answer']!r} · correct {row['correct']} · "
            f"{gradient.completion_token_count(row['labels'])} completion tokens"
        )
        blocks.append(f"{head}\n{format_trace(tok, row['input_ids'], row['labels'])}")
    return "\n\n".join(blocks)


def completion_lengths(run: RunDir) -> list[int]:
    return [gradient.completion_token_count(labels) for labels in load_traces(run)["labels"]]


def length_histogram(run: RunDir):
    """Histogram of the traces' completion lengths in proxy tokens (what each trace's mean runs over)."""
    lengths = completion_lengths(run)
    fig, ax = plt.subplots(figsize=(6, 3))
    lo, hi = min(lengths), max(lengths)
    ax.hist(lengths, bins=range(lo, hi + 2) if hi - lo < 60 else 40, align="left", color="#37a", rwidth=0.9)
    ax.set_xlabel("completion tokens (proxy tokenizer)")
    ax.set_ylabel("traces")
    ax.set_title(f"{len(lengths)} traces, mean {sum(lengths) / len(lengths):.1f} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(run.figure("completion_lengths"), dpi=110)
    return fig


def layer_norm_bars(run: RunDir):
    """The saved gradient's norm per layer (embeddings, each block, final norm, head) as bars."""
    layers = gradient.norms_by_layer(gradfile.read_meta(run.path)["tensor_norms"])
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(layers)), 3.4))
    ax.bar(range(len(layers)), list(layers.values()), color="#3a7")
    ax.set_xticks(
        range(len(layers)), [k.removeprefix("model.") for k in layers], rotation=60, ha="right", fontsize=8
    )
    ax.set_ylabel("gradient norm")
    ax.set_yscale("log")
    ax.set_title("proxy gradient norm per layer", fontsize=10)
    fig.tight_layout()
    fig.savefig(run.figure("grad_norm_by_layer"), dpi=110)
    return fig


def largest_tensors(run: RunDir, k: int = 10) -> list[dict]:
    """The `k` tensors with the largest gradient norm: name, shape, norm, share of the squared norm, RMS."""
    meta = gradfile.read_meta(run.path)
    norms, shapes = meta["tensor_norms"], meta["tensor_shapes"]
    total = sum(v**2 for v in norms.values()) or 1.0
    top = sorted(norms, key=norms.get, reverse=True)[:k]
    return [
        {
            "tensor": name,
            "shape": tuple(shapes[name]),
            "norm": norms[name],
            "share": norms[name] ** 2 / total,
            "rms": norms[name] / max(1, _numel(shapes[name])) ** 0.5,
        }
        for name in top
    ]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_saved(run: RunDir, proxy_model: str, proxy_tokenizer) -> str:
    """Load-check the saved gradient against the proxy's skeleton (no weights) and tokenizer, as ADS will:
    one line saying what was checked."""
    meta = gradfile.check_grads(run.path, model_skeleton(proxy_model), proxy_tokenizer)
    return (
        f"checked: {meta['num_tensors']} tensors, {meta['num_parameters']:,} parameters of "
        f"{meta['proxy_model']}, tokenizer {meta['tokenizer_fingerprint']}"
    )


def figures(run: RunDir) -> None:
    """Every figure of the run, as a headless run keeps them."""
    length_histogram(run)
    layer_norm_bars(run)
