"""antidistill's sweep: the points of the trade-off, and everything they run on that can be checked
before anything is written (config, tokenizers, prompts, the gradient's fit).

    prep = prepare("tiny"); points = sweep_points(prep.cfg)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opdkit import memory
from opdkit.ads import gradfile
from opdkit.config import ConfigError, load_config
from opdkit.data import prompts, tasks, traces
from opdkit.jobs import savegrad
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.models import model_skeleton
from opdkit.run.folders import RunDir

JOB = AntidistillConfig.job
GRADS_DIR = "grads"  # where a run without grads_run keeps the savegrad run it made

GRADIENTS = {"ads": "completion", "ads-answer": "answer"}  # which gradient each ADS method steers by


@dataclass(frozen=True)
class Point:
    """One point of the trade-off: how the teacher samples its traces."""

    method: str  # "ads" (completion gradient), "ads-answer" (answer-token gradient), "temperature" (λ = 0)
    lam: float
    temperature: float

    @property
    def name(self) -> str:
        return f"{self.method}-lam{self.lam:g}-tau{self.temperature:g}"

    @property
    def gradient(self) -> str | None:
        return GRADIENTS.get(self.method)


def sweep_points(cfg: AntidistillConfig) -> list[Point]:
    """ADS points (every λ at every ADS temperature), the answer-gradient ADS points, then the temperature
    sweep; λ = 0 is temperature sampling whatever the sweep, and each (method, λ, τ) runs once."""
    triples = [("ads", lam, tau) for tau in cfg.ads_temperatures for lam in cfg.lams]
    triples += [("ads-answer", lam, tau) for tau in cfg.ads_temperatures for lam in cfg.answer_lams]
    triples += [("temperature", 0.0, tau) for tau in cfg.temperatures]
    out: dict[tuple, Point] = {}
    for method, lam, tau in triples:
        key = (method if lam != 0 else "temperature", lam, tau)
        out.setdefault(key, Point(*key))
    return list(out.values())


@dataclass
class Prepared:
    cfg: AntidistillConfig
    mode: str
    task: tasks.Task
    teacher_tokenizer: PreTrainedTokenizerBase
    proxy_tokenizer: PreTrainedTokenizerBase
    student_tokenizer: PreTrainedTokenizerBase
    train_messages: list[list[dict]]  # the prompts the teacher answers at every point
    train_answers: list[str]
    eval_messages: list[list[dict]]
    eval_answers: list[str]
    dropped: int
    first_prompt: str
    plan: memory.JobPlan | None = None  # what each process will hold, from the models' config.json


def with_system(messages: list[list[dict]], system_prompt: str) -> list[list[dict]]:
    if not system_prompt:
        return messages
    return [[{"role": "system", "content": system_prompt}, *m] for m in messages]


def training_prompts(cfg: AntidistillConfig) -> tuple[list[list[dict]], list[str]]:
    """The head of the seed-shuffled dataset (savegrad's holdout is its tail); tiny: 02's training
    stream."""
    ds = prompts.load_prompts(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def eval_prompts(cfg: AntidistillConfig, task: tasks.Task) -> tuple[list[list[dict]], list[str]]:
    """Held-out problems for the students: `eval_dataset_path`, else the task's own held-out problems."""
    if not cfg.eval_dataset_path:
        try:
            return task.heldout(300 if cfg.eval_size == -1 else cfg.eval_size)
        except ConfigError:
            raise ConfigError(
                f"eval_dataset_path is empty but dataset_path is {cfg.dataset_path!r}; give the evaluation "
                "prompts (e.g. the GSM8K test split as a parquet file)."
            ) from None
    ds = prompts.load_prompts(cfg.eval_dataset_path, cfg.eval_dataset_split, cfg.eval_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def check_grads_run(cfg: AntidistillConfig, proxy_tok: PreTrainedTokenizerBase) -> None:
    """A given grads_run must hold a gradient of this proxy (names, shapes, tokenizer), checked without
    weights."""
    if cfg.grads_run:
        gradfile.check_grads(cfg.grads_run, model_skeleton(cfg.proxy_model), proxy_tok)
        needs_traces = any(lam != 0 for lam in cfg.answer_lams)
        if needs_traces and not (Path(cfg.grads_run) / traces.TRACES_DIR).is_dir():
            raise ConfigError(
                f"answer_lams needs the traces the gradient was computed on, but {cfg.grads_run} has "
                f"no {traces.TRACES_DIR}/; use a savegrad run directory or set answer_lams to []."
            )
    else:
        # An unknown preset fails here, not after the run dir exists.
        load_config(savegrad.SaveGradConfig, cfg.grads_mode)


def load_run_config(run: RunDir | str | Path) -> tuple[AntidistillConfig, str]:
    """The resolved config a antidistill run was made with, and its mode."""
    saved = (run if isinstance(run, RunDir) else RunDir.attach(run)).read_config(JOB)
    names = {f.name for f in fields(AntidistillConfig)}
    return AntidistillConfig(**{k: v for k, v in saved.items() if k in names}), saved.get("mode", "?")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
