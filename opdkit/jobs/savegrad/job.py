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
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

import opdkit
from opdkit import memory, tasks, tiny
from opdkit.ads import gradfile, gradient
from opdkit.config import ConfigError, to_dict
from opdkit.data import prompts
from opdkit.data.labels import completion_labels
from opdkit.data.traces import TRACES_DIR, format_trace, truncated_count
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.savegrad.holdout import holdout_prompts, supplied_traces, traces_for
from opdkit.models import check_shared_vocab, load_model, load_tokenizer
from opdkit.rollout import engines
from opdkit.run import tracking
from opdkit.run.cli import run_from_cli
from opdkit.run.folders import RunDir, print0
from opdkit.run.lifecycle import Job, fit_gen_batch, prepare_job, run_job
from opdkit.tasks.evaluate import fraction_correct


@dataclass
class Prepared:
    cfg: SaveGradConfig
    mode: str
    task: tasks.Task
    proxy_tokenizer: PreTrainedTokenizerBase
    teacher_tokenizer: PreTrainedTokenizerBase | None  # None when traces_path supplies the traces
    # The holdout prompts the teacher answers: the data this job's gradient is computed on (empty when
    # traces_path supplies the traces).
    train_messages: list[list[dict]]
    train_answers: list[str]
    traces: list[dict] | None  # supplied traces: messages ending with the answer, answer
    dropped: int  # holdout prompts dropped as longer than max_prompt_length
    first_example: str  # the first prompt (or supplied trace) as the model sees it


def prepared(cfg: SaveGradConfig, mode: str) -> Prepared:
    """The prompts (or supplied traces), then the tokenizers, in the original's order (data files in
    milliseconds, before any download): every cheap failure happens here."""
    if cfg.max_length and cfg.max_length <= cfg.max_prompt_length:
        raise ConfigError(
            f"max_length={cfg.max_length} leaves no room for a completion after prompts of up to "
            f"max_prompt_length={cfg.max_prompt_length} tokens; raise max_length or set it to 0."
        )
    task = tasks.for_dataset(cfg.dataset_path)
    if cfg.traces_path and cfg.proxy_tokens == "teacher":
        raise ConfigError(
            "proxy_tokens=teacher needs the teacher's own token ids, which only traces generated here have; "
            "with traces_path, set proxy_tokens=proxy (each trace re-rendered in the proxy's chat template)."
        )
    if cfg.traces_path:
        traces = supplied_traces(cfg)
        proxy_tok = load_tokenizer(cfg.proxy_model)
        ids, labels = completion_labels(proxy_tok, traces[0]["messages"], cfg.enable_thinking)
        return Prepared(
            cfg, mode, task, proxy_tok, None, [], [], traces, 0, format_trace(proxy_tok, ids, labels)
        )
    holdout = holdout_prompts(cfg)
    proxy_tok, teacher_tok = load_tokenizer(cfg.proxy_model), load_tokenizer(cfg.teacher_model)
    if cfg.proxy_tokens == "teacher":
        check_shared_vocab(teacher_tok, proxy_tok)  # the proxy reads the teacher's token ids
    holdout, dropped = prompts.filter_long_prompts(
        holdout, teacher_tok, cfg.max_prompt_length, cfg.enable_thinking
    )
    collator = prompts.PromptCollator(teacher_tok, cfg.max_prompt_length, cfg.enable_thinking)
    first = prompts.format_first_prompt(holdout, collator, teacher_tok)
    engines.check_available(cfg.rollout_engine, cfg.dry_run)  # an import check, after the data and tokenizers
    messages, answers = list(holdout["messages"]), list(holdout["answer"])
    return Prepared(cfg, mode, task, proxy_tok, teacher_tok, messages, answers, None, dropped, first)


def stages(prep: Prepared, budget: float | None) -> dict[str, memory.Stage]:
    """What one process holds, for the memory plan, in the job's two stages one after the other: the
    teacher writing traces (the kit's loop, `gen_batch_size` rows, or the vLLM engine's share, which loads
    the teacher itself), then the fp32 proxy's gradient pass (`batch_size` traces, no optimizer; every
    process holds the whole proxy). Without traces_path both; with it the gradient pass only."""
    cfg = prep.cfg
    longest = cfg.max_prompt_length + cfg.max_new_tokens
    trace = (min(longest, cfg.max_length) if cfg.max_length else longest) - cfg.max_prompt_length
    device = "cpu" if budget is None else "cuda"
    out = {}
    if not cfg.traces_path:
        hf = cfg.rollout_engine == "hf"
        out["teacher traces"] = memory.Stage(
            teacher=memory.ModelShape.from_config(cfg.teacher_model) if hf else None,
            teacher_dtype="bfloat16" if cfg.bf16 else "float32",
            bf16=False,
            device=device,
            sampler="teacher",
            gen_batch_size=cfg.gen_batch_size if hf else 0,
            prompt_len=cfg.max_prompt_length,
            completion_len=trace,
            rollout_engine=cfg.rollout_engine,
            vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            engine_dtype="bfloat16" if cfg.bf16 else "float32",
        )
    out["proxy gradient"] = memory.Stage(
        student=memory.ModelShape.from_config(cfg.proxy_model),
        student_dtype="float32",
        bf16=False,
        device=device,
        optimizer="none",
        train_batch_size=cfg.batch_size,
        prompt_len=cfg.max_prompt_length,
        completion_len=trace,
    )
    return out


def fit(prep: Prepared, budget: float | None) -> Prepared:
    """`gen_batch_size` 0: the largest batch of traces that fits (`lifecycle.fit_gen_batch`)."""
    if prep.cfg.traces_path:
        return prep
    return fit_gen_batch(prep, budget, {"teacher traces": stages(prep, budget)["teacher traces"]})


def teacher_accuracy(records: list[dict]) -> float | None:
    """The share of the teacher's checkable traces whose answer is right."""
    return fraction_correct(r.get("correct") for r in records)


def grad_meta(cfg: SaveGradConfig, prep: Prepared, named: dict, stats: dict, world: int) -> dict:
    norms = gradient.tensor_norms(named)
    return {
        "proxy_model": cfg.proxy_model,
        "proxy_path": tiny.resolve(cfg.proxy_model),
        "teacher_model": None if cfg.traces_path else cfg.teacher_model,
        "traces": cfg.traces_path or TRACES_DIR,
        "tokenizer_fingerprint": gradfile.tokenizer_fingerprint(prep.proxy_tokenizer),
        "num_traces": stats["num_traces"],
        "truncated_traces": stats[
            "truncated_traces"
        ],  # their labels end where the teacher stopped, no end of turn
        "completion_tokens": stats["completion_tokens"],
        "normalization": cfg.normalization,
        "proxy_tokens": cfg.proxy_tokens,
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
        "world_size": world,
        "batch_size": cfg.batch_size,
        "dtype": "float32",
        "num_tensors": len(named),
        "num_parameters": sum(g.numel() for g in named.values()),
        "opdkit_version": opdkit.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tensor_norms": norms,
        "tensor_shapes": {k: list(g.shape) for k, g in named.items()},
    }


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
    records: list[dict],
    run: RunDir,
    rank: int,
    world: int,
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], dict]:
    """The fp32 proxy's mean gradient over all traces; a non-finite one marks the run failed, then raises."""
    proxy = load_model(cfg.proxy_model, torch.float32, device)
    pad = prep.proxy_tokenizer.pad_token_id
    try:
        return gradient.mean_completion_grad(
            proxy, records, cfg.normalization, cfg.batch_size, pad, rank, world, rank == 0
        )
    except gradient.NonFiniteGradient as exc:
        run.write_summary({"status": f"failed: {exc}", "num_traces": len(records)})
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
    named, stats = proxy_gradient(cfg, prep, records, run, rank, world, device)
    stats = {**stats, "truncated_traces": truncated_count(records)}
    if rank == 0:
        gradfile.save_grads(run.path, named, grad_meta(cfg, prep, named, stats, world))
    summary = summarize(records, stats, prep, world, time.time() - t0)
    run.write_summary(summary)
    track(cfg, run, summary, records)
    print0(
        f"gradient norm {stats['grad_norm']:.4g} over {stats['completion_tokens']} completion tokens; "
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


def main(argv: list[str] | None = None) -> None:
    from opdkit.jobs.savegrad import report

    run_from_cli(
        SaveGradConfig,
        "Proxy-student gradient for antidistillation (opdkit savegrad).",
        run,
        report.figures,
        argv,
    )


if __name__ == "__main__":
    main()
