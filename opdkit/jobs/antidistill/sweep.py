"""antidistill's sweep: the points of the trade-off, and everything they run on that can be checked
before anything is written (config, tokenizers, prompts, the gradient's fit).

    prep = prepare("tiny"); points = sweep_points(prep.cfg)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opdkit import memory
from opdkit.ads import gradfile
from opdkit.config import ConfigError, load_config
from opdkit import tasks
from opdkit.data import prompts, traces
from opdkit.jobs import savegrad
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.models import model_skeleton
from opdkit.run.folders import RunDir, print0

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
    by_name: dict[str, list[Point]] = {}
    for p in out.values():
        by_name.setdefault(p.name, []).append(p)
    shared = {name: ps for name, ps in by_name.items() if len(ps) > 1}
    if shared:
        listed = "; ".join(
            f"{name}: " + ", ".join(f"λ={p.lam!r} τ={p.temperature!r}" for p in ps)
            for name, ps in shared.items()
        )
        raise ConfigError(
            f"points would share a folder: their names write λ and τ to six significant digits ({listed}); "
            "make the values differ within six digits or drop all but one of each group."
        )
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
    removed: dict[str, int] = field(default_factory=prompts.removed)  # evaluation rows passed over (overlap)
    gradient_holdout: str = ""  # what `check_apart_from_gradient` found
    plan: memory.JobPlan | None = None  # what each process will hold, from the models' config.json


def with_system(messages: list[list[dict]], system_prompt: str) -> list[list[dict]]:
    if not system_prompt:
        return messages
    return [[{"role": "system", "content": system_prompt}, *m] for m in messages]


def training_prompts(cfg: AntidistillConfig) -> tuple[list[list[dict]], list[str]]:
    """The head of the seed-shuffled dataset (savegrad's holdout is its tail); tiny: 02's training
    stream."""
    task = tasks.for_dataset(cfg.dataset_path)
    ds = task.load_prompts(cfg.dataset_path, cfg.dataset_split, cfg.subset_size, cfg.seed)
    return with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])


def eval_prompts(
    cfg: AntidistillConfig, task: tasks.Task, train_messages: list[list[dict]]
) -> tuple[list[list[dict]], list[str], dict[str, int]]:
    """Held-out problems for the students, none of them a training prompt (by `prompts.prompt_key`), so one
    file may serve both: `eval_dataset_path` (the first `eval_size` distinct prompts of its seed shuffle
    that are not trained on), else the task's own held-out problems. Also the rows passed over."""
    taken = prompts.prompt_keys(train_messages)
    if not cfg.eval_dataset_path:
        if not task.has_heldout:
            raise ConfigError(
                f"eval_dataset_path is empty but dataset_path is {cfg.dataset_path!r}; give the evaluation "
                "prompts (e.g. the GSM8K test split as a parquet file)."
            )
        messages, answers = task.heldout(300 if cfg.eval_size == -1 else cfg.eval_size)
        kept = prompts.apart_from(messages, taken)
        held = [messages[i] for i in kept.kept], [answers[i] for i in kept.kept]
    else:
        ds, kept = tasks.for_dataset(cfg.eval_dataset_path).load_apart(
            cfg.eval_dataset_path, cfg.eval_dataset_split, cfg.eval_size, cfg.seed, taken
        )
        held = with_system(list(ds["messages"]), cfg.system_prompt), list(ds["answer"])
    if not held[0]:
        raise ConfigError(
            f"every evaluation prompt of {cfg.eval_dataset_path or 'the held-out problems'} is a training "
            f"prompt ({kept.overlap} passed over); give evaluation prompts apart from dataset_path's first "
            f"subset_size={cfg.subset_size}, or lower subset_size."
        )
    return *held, prompts.removed(eval_in_train=kept.overlap, eval_repeats=kept.repeats)


def grads_overrides(cfg: AntidistillConfig, run_dir: str = "") -> dict:
    """savegrad's overrides when this run computes its own gradient (grads_run empty)."""
    return {
        "teacher_model": cfg.teacher_model,
        "proxy_model": cfg.proxy_model,
        "seed": cfg.seed,
        **({"run_dir": run_dir} if run_dir else {}),
    }


def check_apart_from_gradient(cfg: AntidistillConfig, train_messages: list[list[dict]]) -> str:
    """The teacher's prompts must stay off the holdout the gradient was computed on (ADS steers away from
    what helps a student there, and `student_holdout_loss` is measured on it): `grads_run`'s, rebuilt from its
    config.yaml, or the one `grads_mode` will compute. Any shared prompt is a ConfigError that counts them;
    returns what was checked (for the summary), or that a bare gradient file left nothing to check."""
    if cfg.grads_run:
        holdout, source = savegrad.run_holdout(cfg.grads_run), f"grads_run {cfg.grads_run}"
        if holdout is None:
            print0(
                f"grads_run {cfg.grads_run} has neither config.yaml nor traces/: its holdout is unknown, so "
                "the training prompts are not checked against it"
            )
            return f"not checked: {cfg.grads_run} has neither config.yaml nor traces/"
    else:
        saved = load_config(savegrad.SaveGradConfig, cfg.grads_mode, grads_overrides(cfg))
        holdout, source = savegrad.holdout_messages(saved), f"savegrad --mode {cfg.grads_mode}"
    shared = prompts.overlap_count(train_messages, prompts.prompt_keys(holdout))
    if shared:
        raise ConfigError(
            f"{shared} of the {len(train_messages)} training prompts are in the holdout of {source} "
            f"({len(holdout)} prompts), which the gradient is computed on; antidistillation needs them "
            "apart. Use a gradient computed on the same dataset_path with the same seed (its holdout is the "
            "tail of the shuffle, the training prompts its head) and a holdout_fraction that leaves "
            "subset_size rows before it, or lower subset_size."
        )
    return f"checked: none of the training prompts is among the {len(holdout)} of {source}"


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
