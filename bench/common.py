"""What every benchmark shares: peak-memory probes and the figure two sides' medians make.

    fig = ratio_figure("P1", "OPD optimizer-step throughput", samples, key="tokens_per_s", ...)

Peak RSS is measured above a baseline taken after imports and setup: `reset_peak()` writes 5 to
/proc/self/clear_refs (Linux), which resets VmHWM to the current RSS; `peak_above_baseline()` then
reads VmHWM. Where that file is missing, the peak since process start (ru_maxrss) is used instead.
"""

from __future__ import annotations

import resource
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(key: str) -> int | None:
    if not _STATUS.exists():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def rss_bytes() -> int:
    """Current resident set size."""
    kib = _status_kib("VmRSS")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> int:
    """Make the current RSS the new peak (where the OS allows it); returns that baseline in bytes."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        pass
    return rss_bytes()


def peak_bytes() -> int:
    """Peak RSS since the last `reset_peak` (or process start where it cannot be reset)."""
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def median(samples: list[dict], key: str) -> float:
    return float(statistics.median(s[key] for s in samples))


@dataclass
class Figure:
    """One row of the table and one entry of results.json."""

    figure: str
    name: str
    value: float  # opdkit median / baseline median (or baseline / opdkit when lower is better)
    target: float
    unit: str
    higher_is_better: bool
    metric: str  # what each run measured, e.g. "completion tokens/s"
    opdkit_median: float
    baseline_median: float
    baseline: str
    opdkit_runs: list[float] = field(default_factory=list)
    baseline_runs: list[float] = field(default_factory=list)
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def met(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "met": self.met}


def ratio_figure(
    figure: str,
    name: str,
    samples: dict[str, list[dict]],
    *,
    key: str,
    metric: str,
    target: float,
    higher_is_better: bool,
    baseline: str,
    setup: dict,
    sides: tuple[str, str] = ("opdkit", "baseline"),
) -> Figure:
    """The ratio opdkit median / baseline median of `key`, with the runs behind it."""
    ours, theirs = samples[sides[0]], samples[sides[1]]
    m_ours, m_theirs = median(ours, key), median(theirs, key)
    return Figure(
        figure=figure,
        name=name,
        value=m_ours / m_theirs if m_theirs else float("nan"),
        target=target,
        unit=f"x (opdkit / baseline, {'higher' if higher_is_better else 'lower'} is better)",
        higher_is_better=higher_is_better,
        metric=metric,
        opdkit_median=m_ours,
        baseline_median=m_theirs,
        baseline=baseline,
        opdkit_runs=[s[key] for s in ours],
        baseline_runs=[s[key] for s in theirs],
        setup=setup,
    )


def small_qwen3(hidden: int, layers: int, vocab: int, seed: int, **config: Any):
    """A randomly initialised float32 Qwen3 of any small size (tied embeddings, 64-wide heads, half as many
    KV heads, MLP 3x hidden); `config` adds or overrides Qwen3Config fields (e.g. eos_token_id)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(2, hidden // 64)
    cfg = Qwen3Config(
        **{
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 2),
            "head_dim": hidden // heads,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "pad_token_id": 0,
            **config,
        }
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()
