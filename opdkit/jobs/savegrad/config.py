"""savegrad's settings: `SaveGradConfig`, composed from the settings groups (each declared once, in
`opdkit.settings`) and savegrad's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import RunFields, setting
from opdkit.settings import (
    EngineSettings,
    GradientTokenSettings,
    PrecisionSettings,
    PromptSettings,
    ProxySettings,
    TeacherSettings,
    TraceSettings,
)


@dataclass
class SaveGradConfig(
    RunFields,
    TeacherSettings,
    ProxySettings,
    PromptSettings,
    PrecisionSettings,
    EngineSettings,
    TraceSettings,
    GradientTokenSettings,
):
    """Proxy-student gradient for antidistillation sampling (notebook 01): the teacher writes traces for the
    holdout prompts (`rollout_engine`), the proxy's mean completion gradient on them (on the completion tokens
    `grad_tokens` keeps) is saved."""

    job: ClassVar[str] = "savegrad"

    holdout_fraction: float = setting(
        1.0,
        "the holdout is this fraction of the dataset, its tail after a shuffle by seed (tiny: its own "
        "problem stream)",
        min=0.0,
        max=1.0,
    )
    traces_path: str = setting(
        "", "existing traces (a datasets folder or data file) instead of generating them"
    )
    trace_column: str = setting(
        "messages",
        "column of traces_path: chat messages ending with the assistant's answer, or the answer text next "
        "to a prompt column",
    )
    max_length: int = setting(
        0, "cap on prompt plus trace tokens, as the ADS pipeline's max_length; 0 means no cap", min=0
    )
    trace_temperature: float = setting(
        0.0, "the teacher's sampling temperature for the traces; 0 is greedy", min=0.0
    )
    proxy_tokens: str = setting(
        "proxy",
        "what the proxy reads: proxy, each trace re-rendered in the proxy's chat template; teacher, the "
        "teacher's own prompt and completion token ids (as the ADS reference, and as ADS feeds the proxy "
        "later)",
        choices=("proxy", "teacher"),
    )
    normalization: str = setting(
        "trace",
        "trace: mean over traces of each trace's mean-token gradient; token: mean over all completion tokens",
        choices=("trace", "token"),
    )
    batch_size: int = setting(
        8, "traces per backward pass, per process (the result does not depend on it)", min=1
    )
