"""One point of antidistill's trade-off: the teacher's traces at that point, a fresh student distilled on
them, and both accuracies, kept in points/<name>/seed<seed>/ (reused by resume=True).

    result = run_point(point, prep, models, run, device)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit.ads import sampler
from opdkit.data import prompts
from opdkit.jobs.antidistill.attackers import mean_over_runs, run_attackers
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.steering import Models
from opdkit.jobs.antidistill.students import (
    distill_student,
    fresh_student,
    holdout_loss,
    keep_student,
    sft_rows,
    sft_seed,
    student_accuracies,
)
from opdkit.jobs.antidistill.sweep import Point, Prepared
from opdkit.models import eos_ids
from opdkit.rollout import sampling
from opdkit.run.files import atomic_write_text, read_jsonl, write_jsonl
from opdkit.run.folders import RunDir, print0
from opdkit.tasks.evaluate import fraction_correct

POINTS_DIR = "points"
TRACES_FILE = "traces.jsonl"  # a point's traces, reused by resume=True when complete


def write_traces(
    cfg: AntidistillConfig, prep: Prepared, models: Models, point: Point, seed: int, dev: torch.device
) -> list[dict]:
    """The teacher answers every training prompt at this point; each record says whether its answer is
    right."""
    tok, check = prep.teacher_tokenizer, prep.task.check
    eos = eos_ids(tok, models.teacher)
    ids = [prompts.prompt_ids(tok, m, cfg.enable_thinking) for m in prep.train_messages]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))  # similar lengths share a batch
    direction = models.direction(point.gradient) if point.gradient else None
    torch.manual_seed(seed)  # the same noise at every point of a repeat: the sweeps differ only by λ and τ
    texts: dict[int, tuple[str, bool]] = {}
    batches = range(0, len(order), cfg.gen_batch_size)
    for s in tqdm(batches, desc=f"traces {point.name}", leave=False):
        batch = order[s : s + cfg.gen_batch_size]
        prompts_BP, mask_BP = sampling.left_pad([ids[i] for i in batch], tok.pad_token_id, dev)
        r = sampler.ads_sample(
            models.teacher,
            prompts_BP,
            mask_BP,
            direction=direction,
            lam=point.lam,
            temperature=point.temperature,
            top_p=cfg.top_p,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=cfg.max_new_tokens,
            top_k=cfg.top_k,
        )
        done = ~r.truncated_B(eos)
        for b, (i, text) in enumerate(zip(batch, sampling.decode_completions(tok, r))):
            texts[i] = (text, not bool(done[b]))
    return [
        {
            "messages": prep.train_messages[i],
            "completion": texts[i][0],
            "answer": prep.train_answers[i],
            "correct": check(texts[i][0], prep.train_answers[i]) if prep.train_answers[i] else None,
            "truncated": texts[i][1],
        }
        for i in range(len(ids))
    ]


def saved_traces(path: Path, prep: Prepared) -> list[dict] | None:
    """A point's traces written by an earlier run, when they are complete: one record with a completion
    per training prompt, in order. None (with the reason said) when they must be written again."""
    if not path.is_file():
        return None
    records = read_jsonl(path)  # written atomically: the whole file or none
    problem = None
    if len(records) != len(prep.train_messages):
        problem = f"{len(records)} traces for {len(prep.train_messages)} training prompts"
    elif any(r.get("messages") != m or "completion" not in r for r, m in zip(records, prep.train_messages)):
        problem = "their prompts are not this run's training prompts"
    if problem:
        print0(f"resume: writing the traces again, {path} does not fit ({problem})")
        return None
    print0(f"resume: reusing the {len(records)} traces in {path}")
    return records


def run_once(point: Point, seed: int, prep: Prepared, models: Models, run: RunDir, dev: torch.device) -> dict:
    """Traces at this point, a fresh student distilled on them, both accuracies; in
    points/<name>/seed<seed>/."""
    cfg, folder = prep.cfg, run.path / POINTS_DIR / point.name / f"seed{seed}"
    if cfg.resume and (folder / "result.json").is_file():
        print0(f"resume: reusing {folder / 'result.json'}")
        return json.loads((folder / "result.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    records = saved_traces(folder / TRACES_FILE, prep) if cfg.resume else None
    if records is None:
        records = write_traces(cfg, prep, models, point, seed, dev)
        write_jsonl(folder / TRACES_FILE, records)
    offload(models, dev, off=True)
    student = fresh_student(cfg, dev, sft_seed(cfg, seed))
    rows = sft_rows(records, prep.student_tokenizer, cfg)
    trainer = distill_student(
        student, rows, cfg, prep.student_tokenizer, sft_seed(cfg, seed), folder, f"{point.name}-seed{seed}"
    )
    student = keep_student(trainer.model, cfg, prep.student_tokenizer, folder)
    steps = trainer.step_log()
    raw, forced = student_accuracies(student, prep)
    result = {
        "seed": seed,
        "teacher_accuracy": fraction_correct(r["correct"] for r in records),
        "student_accuracy": raw,
        "student_accuracy_forced": forced,
        "student_holdout_loss": holdout_loss(
            student,
            models.holdout,
            prep.student_tokenizer.pad_token_id,
            cfg.sft_micro_batch_size or cfg.sft_batch_size,
        ),
        "truncated_fraction": sum(r["truncated"] for r in records) / len(records),
        "num_traces": len(records),
        "errors": prep.task.error_kinds(records),
        "sft_steps": trainer.state.global_step,
        "final_sft_loss": steps[-1]["loss"] if steps else None,
        "seconds": round(time.time() - t0, 1),
    }
    trainer.log(
        {
            k: result[k]
            for k in (
                "teacher_accuracy",
                "student_accuracy",
                "student_accuracy_forced",
                "student_holdout_loss",
            )
            if result[k] is not None
        }
    )  # to report_to, after the SFT steps
    result.update(
        run_attackers(point, seed, prep, models, run, folder, dev)
    )  # the on-policy attackers, if any
    write_jsonl(folder / "metrics.jsonl", steps)
    atomic_write_text(folder / "result.json", json.dumps(result, indent=2))
    del trainer
    del student
    offload(models, dev, off=False)
    return result


def offload(models: Models, dev: torch.device, off: bool) -> None:
    """On a GPU, teacher and proxies wait in CPU memory while a student trains (a 7B teacher, two fp32 3B
    proxies and a 3B student with AdamW states do not fit one 80 GB GPU together); on a CPU, nothing moves."""
    if dev.type != "cuda":
        return
    target = "cpu" if off else dev
    models.teacher.to(target)
    for direction in models.directions.values():
        direction.to(target)
    torch.cuda.empty_cache()


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _mean_errors(values: list[dict | None]) -> dict[str, float] | None:
    kept = [v for v in values if v]
    return {k: sum(v[k] for v in kept) / len(kept) for k in kept[0]} if kept else None


def run_point(point: Point, prep: Prepared, models: Models, run: RunDir, dev: torch.device) -> dict:
    """The point's `repeats` runs (seeds seed, seed+1, ...) and their mean accuracies: one summary entry."""
    cfg = prep.cfg
    runs = [run_once(point, cfg.seed + k, prep, models, run, dev) for k in range(cfg.repeats)]
    return {
        **asdict(point),
        "name": point.name,
        "teacher_accuracy": _mean([r["teacher_accuracy"] for r in runs]),
        "student_accuracy": _mean([r["student_accuracy"] for r in runs]),
        "student_accuracy_forced": _mean([r.get("student_accuracy_forced") for r in runs]),
        "student_holdout_loss": _mean([r.get("student_holdout_loss") for r in runs]),
        "errors": _mean_errors([r.get("errors") for r in runs]),
        **mean_over_runs(runs),
        "runs": runs,
        "seconds": round(sum(r["seconds"] for r in runs), 1),
    }


def baseline(prep: Prepared, models: Models, dev: torch.device) -> dict:
    """The student before any distillation, where every point starts from: accuracy and held-out loss."""
    cfg, student = prep.cfg, fresh_student(prep.cfg, dev, sft_seed(prep.cfg, prep.cfg.seed))
    loss = holdout_loss(
        student,
        models.holdout,
        prep.student_tokenizer.pad_token_id,
        cfg.sft_micro_batch_size or cfg.sft_batch_size,
    )
    raw, forced = student_accuracies(student, prep)
    return {
        "student_accuracy_before": raw,
        "student_accuracy_before_forced": forced,
        "student_holdout_loss_before": loss,
    }
