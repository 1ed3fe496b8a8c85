"""savegrad's settings: `SaveGradConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from opdkit.config import RunFields, setting
from opdkit.rollout.engines import EngineSettings


@dataclass
class SaveGradConfig(RunFields, EngineSettings):
    """Proxy-student gradient for antidistillation sampling (notebook 01). `rollout_engine` writes the
    teacher's traces."""

    job: ClassVar[str] = "savegrad"

    teacher_model: str = setting(
        "tiny:teacher", "teacher that writes the holdout traces: folder, hub name, or tiny:teacher"
    )
    proxy_model: str = setting(
        "tiny:student", "proxy student whose gradient is saved: folder, hub name, or tiny:student"
    )
    dataset_path: str = setting(
        "tiny",
        "holdout prompts: tiny, a parquet/jsonl/json/arrow file, a saved datasets folder, or a hub name",
    )
    dataset_split: str = setting("train", "split to read from a datasets folder or hub dataset")
    holdout_fraction: float = setting(
        1.0,
        "the holdout is this fraction of the dataset, its tail after a shuffle by seed (tiny: its own "
        "problem stream)",
        min=0.0,
        max=1.0,
    )
    subset_size: int = setting(256, "holdout prompts used, the first of the holdout; -1 means all", min=-1)
    system_prompt: str = setting("", "system message put before every holdout prompt; empty for none")
    traces_path: str = setting(
        "", "existing traces (a datasets folder or data file) instead of generating them"
    )
    trace_column: str = setting(
        "messages",
        "column of traces_path: chat messages ending with the assistant's answer, or the answer text next "
        "to a prompt column",
    )
    max_prompt_length: int = setting(512, "longer holdout prompts are dropped (and counted)", min=1)
    max_new_tokens: int = setting(512, "trace length budget: tokens the teacher writes at most", min=1)
    max_length: int = setting(
        0, "cap on prompt plus trace tokens, as the ADS pipeline's max_length; 0 means no cap", min=0
    )
    enable_thinking: bool = setting(False, "passed to the chat templates (Qwen3 thinking mode)")
    gen_temperature: float = setting(0.0, "teacher sampling temperature for the traces; 0 is greedy", min=0.0)
    gen_top_p: float = setting(
        1.0, "nucleus of the teacher's sampling (unused when greedy)", min=1e-3, max=1.0
    )
    gen_batch_size: int = setting(
        64,
        "prompts per generation batch, per process; 0 means the largest batch that fits the memory plan "
        "(rollout_engine hf)",
        min=0,
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
    bf16: bool = setting(False, "bf16 teacher for generation (GPU); the proxy always runs in fp32")
