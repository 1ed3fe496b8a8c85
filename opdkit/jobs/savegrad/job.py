"""Proxy-student gradient for antidistillation sampling, the job behind notebooks/01_save_grad.ipynb
(traces: `traces.py`; its report: `report.py`).

    python -m opdkit.savegrad --mode tiny                                          # CPU, seconds
    python -m opdkit.savegrad --mode full --set num_processes=4                    # one node, 4 GPUs
    torchrun --nproc_per_node 8 -m opdkit.savegrad --mode ads-paper --set run_dir=runs/ads

The teacher writes completions for holdout prompts (or `traces_path` supplies them); the proxy
student's mean completion-only gradient on them is saved in the run directory:

    traces/             datasets folder, one row per trace: messages, input_ids, labels (exactly what the
                        gradient was computed on; -100 outside the completion), answer, correct, truncated
    grads.safetensors   fp32 gradient; keys are the proxy's named_parameters() names (tied weights once)
    grads.json          proxy, tokenizer fingerprint, counts, normalization, world size, norms, version, time

A recipe over `ads.gradient` and the run lifecycle (`run.lifecycle`): `prepare` does everything that can fail
cheaply before anything is written; every process writes its share of the traces and takes the proxy's
gradient over all of them. The antidistillation notebook reads the gradient with
`opdkit.ads.gradfile.load_grads(run_dir, proxy, tokenizer)`.
"""

from __future__ import annotations

import os
import time

import torch

from opdkit import memory, tiny
from opdkit.ads import gradfile, gradient, tokenkinds
from opdkit.config import ConfigError, to_dict
from opdkit.data.traces import TRACES_DIR, truncated_count
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.savegrad.holdout import Prepared, gather, prepared, traces_for
from opdkit.models import load_model
from opdkit.rollout import engines
from opdkit.run import tracking
from opdkit.run.folders import RunDir, print0
from opdkit.run.lifecycle import Job, fit_trace_batch, prepare_job, run_job
from opdkit.tasks.evaluate import fraction_correct


def stages(prep: Prepared, budget: float | None) -> dict[str, memory.Stage]:
    """What one process holds, for the memory plan, in the job's two stages one after the other: the teacher
    writing traces (`rollout.engines.trace_stage`), then the fp32 proxy's gradient pass
    (`ads.gradient.gradient_stage`). Without traces_path both; with it the gradient pass only."""
    cfg = prep.cfg
    longest = cfg.max_prompt_length + cfg.trace_max_new_tokens
    trace = (min(longest, cfg.max_length) if cfg.max_length else longest) - cfg.max_prompt_length
    out = {} if cfg.traces_path else {"teacher traces": engines.trace_stage(cfg, trace, budget)}
    gpu = budget is not None
    out["proxy gradient"] = gradient.gradient_stage(
        cfg.proxy_model, cfg.batch_size, cfg.max_prompt_length, trace, gpu
    )
    return out


def fit(prep: Prepared, budget: float | None) -> Prepared:
    """`trace_batch_size` 0: the largest batch of traces that fits (`lifecycle.fit_trace_batch`)."""
    if prep.cfg.traces_path:
        return prep
    return fit_trace_batch(prep, budget, {"teacher traces": stages(prep, budget)["teacher traces"]})


def teacher_accuracy(records: list[dict]) -> float | None:
    """The share of the teacher's checkable traces whose answer is right."""
    return fraction_correct(r.get("correct") for r in records)


def grad_meta(
    cfg: SaveGradConfig, prep: Prepared, named: dict, stats: dict, world: int, kinds: dict | None = None
) -> dict:
    """grads.json: which proxy, teacher and traces, which completion tokens (`grad_tokens`, and the kinds'
    token counts when they were told apart), how the gradient was normalised, and the pass's numbers."""
    return gradfile.describe(
        named,
        {k: stats[k] for k in ("num_traces", "truncated_traces", "completion_tokens", "loss", "grad_norm")},
        prep.proxy_tokenizer,
        proxy_model=cfg.proxy_model,
        proxy_path=tiny.resolve(cfg.proxy_model),
        teacher_model=None if cfg.traces_path else cfg.teacher_model,
        traces=cfg.traces_path or TRACES_DIR,
        normalization=cfg.normalization,
        grad_tokens=cfg.grad_tokens,
        **({"grad_entropy": cfg.grad_entropy} if cfg.grad_tokens == "confident" else {}),
        **({"token_kinds": kinds} if kinds else {}),
        proxy_tokens=cfg.proxy_tokens,
        world_size=world,
        batch_size=cfg.batch_size,
    )


def gradient_rows(
    cfg: SaveGradConfig, prep: Prepared, records: list[dict], rank: int, world: int, device: torch.device
) -> tuple[list[dict], dict]:
    """The rows the gradient is taken on, and the kinds' token counts ({} when the kinds were not told apart):
    grad_tokens all, the traces themselves (the gradient as it always was); answer, each trace's answer
    tokens; confident, every completion token but the uncertain ones (the teacher's entropies over this
    process's share of the traces, gathered in every process). One line when no trace keeps a token."""
    if cfg.grad_tokens == "all":
        return records, {}
    tok, answer_start = prep.proxy_tokenizer, prep.task.answer_start
    if cfg.grad_tokens == "answer":
        rows, counts = tokenkinds.answer_rows(records, tok, answer_start), {}
    else:
        mine = gradient.shard_by_length([len(r["input_ids"]) for r in records], rank, world)
        teacher = load_model(cfg.teacher_model, torch.bfloat16 if cfg.bf16 else torch.float32, device).eval()
        pad = tok.pad_token_id
        local = tokenkinds.teacher_entropies(teacher, [records[i] for i in mine], cfg.batch_size, pad)
        del teacher
        engines.free_memory()
        entropies = [h for _, h in sorted(gather(list(zip(mine, local)), world))]
        kinds = tokenkinds.token_kinds(records, entropies, tok, answer_start, cfg.grad_entropy)
        rows = tokenkinds.keep_kinds(records, kinds, tokenkinds.GRAD_TOKENS[cfg.grad_tokens])
        counts = tokenkinds.kind_counts(kinds)
    if not rows:
        raise ConfigError(
            f"grad_tokens={cfg.grad_tokens} keeps no completion token of the {len(records)} traces (no "
            "final answer, or every token uncertain); nothing was saved. Use grad_tokens all, or raise "
            "grad_entropy."
        )
    return rows, counts


def summarize(records: list[dict], stats: dict, prep: Prepared, world: int, seconds: float) -> dict:
    lengths = [gradient.completion_token_count(r["labels"]) for r in records]
    truncated = [r["truncated"] for r in records if r.get("truncated") is not None]
    return {
        "status": "done",
        "num_traces": len(records),
        "truncated_traces": stats["truncated_traces"],
        "completion_tokens": sum(lengths),
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "teacher_accuracy": teacher_accuracy(records),
        "truncated_fraction": sum(truncated) / len(truncated) if truncated else None,
        "prompts_dropped": prep.dropped,
        "normalization": prep.cfg.normalization,
        "grad_tokens": prep.cfg.grad_tokens,
        "gradient_traces": stats["num_traces"],
        "gradient_tokens": stats["completion_tokens"],
        "proxy_loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "world_size": world,
        "batch_size": prep.cfg.batch_size,
        "wall_time_s": round(seconds, 1),
    }


def _share_cpu(world: int, device: torch.device) -> None:
    """Processes sharing one CPU split its cores instead of each spinning up a thread per core."""
    if device.type == "cpu" and world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


def proxy_gradient(
    cfg: SaveGradConfig,
    prep: Prepared,
    rows: list[dict],
    run: RunDir,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The fp32 proxy's mean gradient over all `rows`; a non-finite one marks the run failed, then raises."""
    proxy = load_model(cfg.proxy_model, torch.float32, device)
    pad = prep.proxy_tokenizer.pad_token_id
    try:
        return gradient.mean_completion_grad(
            proxy, rows, cfg.normalization, cfg.batch_size, pad, rank, world, rank == 0
        )
    except gradient.NonFiniteGradient as exc:
        run.write_summary({"status": f"failed: {exc}", "num_traces": len(rows)})
        raise


def process(prep: Prepared, run: RunDir) -> None:
    """What every process runs: traces, the proxy's mean gradient over all of them, files on rank 0."""
    from accelerate import PartialState  # here, not at import: nothing may touch CUDA before the fork

    t0, cfg = time.time(), prep.cfg
    state = PartialState(cpu=not torch.cuda.is_available())
    world, rank, device = state.num_processes, state.process_index, state.device
    _share_cpu(world, device)
    run.write_env(world_size=world)
    records = traces_for(cfg, prep, run, rank, world, device)
    print0(
        f"{len(records)} traces; teacher accuracy {teacher_accuracy(records)}; "
        f"{world} process(es) on {device}"
    )
    rows, kinds = gradient_rows(cfg, prep, records, rank, world, device)
    named, stats = proxy_gradient(cfg, prep, rows, run, rank, world, device)
    stats = {**stats, "truncated_traces": truncated_count(records)}
    if rank == 0:
        gradfile.save_grads(run.path, named, grad_meta(cfg, prep, named, stats, world, kinds))
    summary = summarize(records, stats, prep, world, time.time() - t0)
    run.write_summary(summary)
    track(cfg, run, summary, records)
    print0(
        f"gradient norm {stats['grad_norm']:.4g} over {stats['completion_tokens']} completion tokens "
        f"(grad_tokens {cfg.grad_tokens}); "
        f"{run.path}"
    )
    state.wait_for_everyone()


def track(cfg: SaveGradConfig, run: RunDir, summary: dict, records: list[dict], rows: int = 32) -> None:
    """The summary's numbers and the first `rows` traces as a table, to the `report_to` tracker (rank 0)."""
    tracker = tracking.Tracker.start(cfg.report_to, run, config=to_dict(cfg))
    tracker.log(summary, step=0)
    tracker.table(
        "traces",
        [
            {
                "prompt": r["messages"][-2]["content"],
                "trace": r["messages"][-1]["content"],
                "answer": r.get("answer"),
                "correct": r.get("correct"),
            }
            for r in records[:rows]
        ],
    )
    tracker.finish()


JOB = Job("savegrad", SaveGradConfig, prepare=prepared, stages=stages, process=process, fit=fit)


def prepare(mode: str = "tiny", overrides: dict | None = None) -> Prepared:
    """Everything that can fail cheaply, nothing written (`lifecycle.prepare_job`)."""
    return prepare_job(JOB, mode, overrides)


def run(mode: str = "tiny", overrides: dict | None = None, prepared: Prepared | None = None) -> RunDir | None:
    """The run (`lifecycle.run_job`): its folder, or None after a dry run."""
    return run_job(JOB, mode, overrides, prepared)
