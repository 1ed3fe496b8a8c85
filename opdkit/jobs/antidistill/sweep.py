"""04_antidistill's sweep: the points of the trade-off, and everything they run on that can be checked
before anything is written (config, tokenizers, prompts, the gradient's fit).

    prep = prepare("tiny"); points = sweep_points(prep.cfg)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opdkit import data, gradfile, tasks, traces, tracking
from opdkit.config import AntidistillationConfig, ConfigError, load_config
from opdkit.models import check_shared_vocab, load_tokenizer, model_skeleton

JOB = "04_antidistill"
SAVEGRAD_JOB = "01_save_grad"

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


def sweep_points(cfg: AntidistillationConfig) -> list[Point]:
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
    cfg: AntidistillationConfig
    mode: str
    task: tasks.Task
    teacher_tokenizer: PreTrainedTokenizerBase
    proxy_tokenizer: PreTrainedTokenizerBase
    student_tokenizer: PreTrainedTokenizerBase
    messages: list[list[dict]]  # training prompts
    answers: list[str]
    eval_messages: list[list[dict]]
    eval_answers: list[str]
    dropped: int
    first_prompt: str


def with_system(messages: list[list[dict]], system_prompt: str) -> list[list[dict]]:
    if not system_prompt:
        return messages
    return [[{"role": "system", "content": system_prompt}, *m] for m in messages]


def training_prompts(cfg: AntidistillationConfig) -> tuple[list[list[dict]], list[str]]:
    """The head of the seed-shuffled dataset (01_save_grad's holdout is its tail); tiny: 02's training
    stream."""
    ds = data.load_prompts(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def eval_prompts(cfg: AntidistillationConfig, task: tasks.Task) -> tuple[list[list[dict]], list[str]]:
    """Held-out problems for the students: `eval_dataset_path`, else the task's own held-out problems."""
    if not cfg.eval_dataset_path:
        try:
            return task.heldout(300 if cfg.eval_size == -1 else cfg.eval_size)
        except ConfigError:
            raise ConfigError(
                f"eval_dataset_path is empty but dataset_path is {cfg.dataset_path!r}; give the evaluation "
                "prompts (e.g. the GSM8K test split as a parquet file)."
            ) from None
    ds = data.load_prompts(cfg.eval_dataset_path, cfg.eval_dataset_split, cfg.eval_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def _drop_long(messages: list, answers: list, tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig):
    keep = [
        i
        for i, m in enumerate(messages)
        if len(data.prompt_ids(tok, m, cfg.enable_thinking)) <= cfg.max_prompt_length
    ]
    return [messages[i] for i in keep], [answers[i] for i in keep], len(messages) - len(keep)


def check_grads_run(cfg: AntidistillationConfig, proxy_tok: PreTrainedTokenizerBase) -> None:
    """A given grads_run must hold a gradient of this proxy (names, shapes, tokenizer), checked without
    weights."""
    if cfg.grads_run:
        gradfile.check_grads(cfg.grads_run, model_skeleton(cfg.proxy_model), proxy_tok)
        needs_traces = any(lam != 0 for lam in cfg.answer_lams)
        if needs_traces and not (Path(cfg.grads_run) / traces.TRACES_DIR).is_dir():
            raise ConfigError(
                f"answer_lams needs the traces the gradient was computed on, but {cfg.grads_run} has "
                f"no {traces.TRACES_DIR}/; use a 01_save_grad run directory or set answer_lams to []."
            )
    else:
        load_config(
            SAVEGRAD_JOB, cfg.grads_mode
        )  # an unknown preset fails here, not after the run dir exists


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Resolve the config, then the prompts, then the tokenizers, then the gradient's fit to the proxy, in the
    original's order (data files in milliseconds, before any download): every cheap failure happens here."""
    cfg = load_config(JOB, mode, overrides)
    tracking.check_report_to(cfg.report_to)
    task = tasks.for_dataset(cfg.dataset_path)
    messages, answers = training_prompts(cfg)
    eval_messages, eval_answers = eval_prompts(cfg, task)
    teacher_tok = load_tokenizer(cfg.teacher_model)
    proxy_tok = load_tokenizer(cfg.proxy_model)
    student_tok = load_tokenizer(cfg.student_tokenizer or cfg.student_model)
    check_shared_vocab(teacher_tok, proxy_tok)
    check_grads_run(cfg, proxy_tok)
    if cfg.student_lora_r and importlib.util.find_spec("peft") is None:
        raise ConfigError(
            "student_lora_r > 0 needs peft; install it with pip install 'opdkit[lora]' (or pip install peft)."
        )
    messages, answers, dropped = _drop_long(messages, answers, teacher_tok, cfg)
    if not messages:
        raise ConfigError(
            f"every training prompt is longer than max_prompt_length={cfg.max_prompt_length}; raise it."
        )
    first = teacher_tok.decode(data.prompt_ids(teacher_tok, messages[0], cfg.enable_thinking))
    return Prepared(
        cfg,
        mode,
        task,
        teacher_tok,
        proxy_tok,
        student_tok,
        messages,
        answers,
        eval_messages,
        eval_answers,
        dropped,
        first,
    )


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
