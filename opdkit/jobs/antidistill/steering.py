"""The steering side of antidistill: the teacher, the proxy, its gradients (savegrad's completion
gradient, and the answer-token gradient computed here from the same traces) and the ADS direction in use.

    models = load_models(cfg, prep, grads_dir, device, run); direction = models.direction("completion")
"""

from __future__ import annotations

import copy
import multiprocessing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from opdkit.ads import gradfile
from opdkit.ads.direction import Direction, make_direction
from opdkit.ads.gradient import global_norm, mean_completion_grad
from opdkit.config import ConfigError
from opdkit import tasks
from opdkit.data import sft, traces
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.students import holdout_rows
from opdkit.jobs.antidistill.sweep import Prepared, sweep_points
from opdkit.models import load_model, load_tokenizer
from opdkit.run.folders import RunDir

ANSWER_GRADS_DIR = "grads_answer"


@dataclass
class Models:
    """What every point shares: the teacher, the fp32 proxy (in CPU memory) with its gradients, and the ADS
    direction of the gradient in use (one pair of perturbed copies at a time, built when first needed)."""

    teacher: torch.nn.Module
    proxy: torch.nn.Module
    grads: dict[str, dict[str, torch.Tensor]]  # "completion" (savegrad's), "answer" (answer tokens only)
    method: str
    eps: float
    device: torch.device
    holdout: list[dict]  # the gradient's holdout traces in the student's tokens (for `holdout_loss`)
    directions: dict[str, Direction] = field(default_factory=dict)

    def direction(self, gradient: str) -> Direction:
        if gradient not in self.directions:
            self.directions.clear()  # free the other gradient's copies first
            built = make_direction(self.method, self.proxy, self.grads[gradient], self.eps)
            self.directions[gradient] = built.to(self.device)
        return self.directions[gradient]

    def grad_norms(self) -> dict[str, float]:
        return {k: global_norm(g) for k, g in self.grads.items()}


def load_models(
    cfg: AntidistillConfig, prep: Prepared, grads_dir: Path, dev: torch.device, run: RunDir | None = None
) -> Models:
    """Teacher on `dev`; proxy and gradients in CPU memory (the perturbed copies go to `dev` when built)."""
    dtype = torch.bfloat16 if cfg.bf16 and dev.type == "cuda" else torch.float32
    teacher = load_model(cfg.teacher_model, dtype, dev).eval()
    proxy = load_model(cfg.proxy_model, torch.float32, "cpu").eval()
    named = {"completion": gradfile.load_grads(grads_dir, proxy, prep.proxy_tokenizer)}
    if needs_answer_gradient(cfg):
        named["answer"] = answer_gradient(cfg, proxy, prep.proxy_tokenizer, grads_dir, run)
    if cfg.grad_scale != 1.0:  # e.g. the ADS reference's 1/W-scaled gradient (W = 8 DDP processes)
        named = {kind: {k: g * cfg.grad_scale for k, g in g_named.items()} for kind, g_named in named.items()}
    holdout = holdout_rows(grads_dir, prep.student_tokenizer, cfg)
    return Models(teacher, proxy, named, cfg.ads_method, cfg.eps, dev, holdout)


def answer_labels(
    tok: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int], start: int
) -> list[int]:
    """`labels` with everything before the answer (character `start` of the completion) set to -100: the first
    completion token whose decoded prefix reaches past `start`, found by bisection, and all after it."""
    pos = [i for i, t in enumerate(labels) if t != sft.IGNORE]
    lo, hi = 0, len(pos) - 1
    while lo < hi:  # smallest j with len(decode(completion[: j + 1])) > start
        mid = (lo + hi) // 2
        if len(tok.decode(input_ids[pos[0] : pos[mid] + 1], skip_special_tokens=True)) > start:
            hi = mid
        else:
            lo = mid + 1
    return [t if i >= pos[lo] else sft.IGNORE for i, t in enumerate(labels)]


def answer_rows(held: list[dict], tok: PreTrainedTokenizerBase, task: tasks.Task) -> list[dict]:
    """The gradient run's traces with the loss on their answer tokens only; traces without an answer are
    left out."""
    rows = []
    for t in held:
        start = task.answer_start(t["messages"][-1]["content"])
        if start is not None and any(x != sft.IGNORE for x in t["labels"]):
            rows.append(
                {
                    "input_ids": t["input_ids"],
                    "labels": answer_labels(tok, t["input_ids"], t["labels"], start),
                }
            )
    if not rows:
        raise ConfigError(
            "no trace of the gradient run has a final answer to take the answer-token gradient on; "
            "leave answer_lams empty."
        )
    return rows


def answer_gradient(
    cfg: AntidistillConfig,
    proxy: torch.nn.Module,
    tok: PreTrainedTokenizerBase,
    grads_dir: Path,
    run: RunDir | None,
) -> dict[str, torch.Tensor]:
    """The proxy's mean NLL gradient on the answer tokens of the gradient run's traces (same normalisation as
    savegrad), on the proxy's device, saved in grads_answer/ of this run; loaded from there when it exists
    (a sweep's processes always find it: `ensure_answer_gradient` writes it before they start)."""
    saved = run.path / ANSWER_GRADS_DIR if run is not None else None
    if saved is not None and (saved / gradfile.GRADS_FILE).is_file():
        return gradfile.load_grads(saved, proxy, tok)
    if not (Path(grads_dir) / traces.TRACES_DIR).is_dir():
        raise ConfigError(
            f"answer_lams needs the traces the gradient was computed on, but {grads_dir} has no "
            f"{traces.TRACES_DIR}/; use a savegrad run directory or leave answer_lams empty."
        )
    meta = gradfile.read_meta(grads_dir)
    rows = answer_rows(list(traces.load_traces(grads_dir)), tok, tasks.for_dataset(cfg.dataset_path))
    work = copy.deepcopy(proxy)
    named, stats = mean_completion_grad(
        work, rows, meta.get("normalization", "trace"), 8, tok.pad_token_id, progress=True
    )
    named = {k: v.detach().to("cpu", torch.float32).clone() for k, v in named.items()}
    if saved is not None and run.writer:
        saved.mkdir(exist_ok=True)
        gradfile.save_grads(
            saved, named, {**meta, **stats, "tokens": "answer", "derived_from": str(grads_dir)}
        )
    return named


def needs_answer_gradient(cfg: AntidistillConfig) -> bool:
    return any(p.gradient == "answer" for p in sweep_points(cfg))


def compute_answer_gradient(cfg_dict: dict, grads_dir: str, run_path: str, device: str) -> None:
    """The answer-token gradient of a run, computed on `device` and saved in its grads_answer/."""
    cfg = AntidistillConfig(**cfg_dict)
    proxy = load_model(cfg.proxy_model, torch.float32, device).eval()
    answer_gradient(cfg, proxy, load_tokenizer(cfg.proxy_model), Path(grads_dir), RunDir.attach(run_path))


def ensure_answer_gradient(cfg: AntidistillConfig, grads_dir: Path, run: RunDir, num_processes: int) -> None:
    """Compute the answer-token gradient once, before the sweep's processes start, so that each of them loads
    it from grads_answer/ instead of computing it again: on the first GPU when there is one (in a process of
    its own when the sweep forks several, which must find CUDA untouched here), else on the CPU."""
    if not needs_answer_gradient(cfg) or (run.path / ANSWER_GRADS_DIR / gradfile.GRADS_FILE).is_file():
        return
    args = (asdict(cfg), str(grads_dir), str(run.path))
    if torch.cuda.device_count() == 0:  # NVML's count: safe before a fork
        compute_answer_gradient(*args, "cpu")
    elif num_processes == 1:
        compute_answer_gradient(*args, "cuda")
    else:
        worker = multiprocessing.get_context("spawn").Process(
            target=compute_answer_gradient, args=(*args, "cuda")
        )
        worker.start()
        worker.join()
        if worker.exitcode != 0:
            raise RuntimeError(
                f"computing the answer-token gradient failed (exit code {worker.exitcode}; its traceback is "
                f"above); the gradient in {grads_dir} and its traces/ are its inputs."
            )
