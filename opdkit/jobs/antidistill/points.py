"""One point of antidistill's trade-off, and its attackers: the teacher's traces at the point, a fresh student
distilled on them by SFT (`sft.student`), the on-policy attackers when asked, their accuracies; kept in
points/<name>/seed<seed>/ (reused by resume=True).

    held = Held(steering, holdout_rows, device, run)
    result = point_result(point, prep, held)             # points/<name>/point.json, done or failed

The attackers, who distil the teacher at each point:

    sft        a fresh student fine-tuned on the teacher's traces at the point (the ADS paper's attacker)
    opd        a fresh student distilled on-policy by 02's `DistillTrainer` with 02's settings (`OPDSettings`,
               `OPDTraining` in this job's config): it samples its own completions and the teacher scores them
               with the distribution it samples from at the point, (z_teacher + λ·Δ) / τ (`ADSTeacher`); it
               never sees the traces
    opd-plain  the same, the teacher scoring with its plain log-probs at τ, λ = 0 (the control: ADS changes
    only
               what the teacher samples, and this attacker reads no sample)

Each on-policy student starts from the same fresh student as SFT's (the run's SFT seed); its greedy held-out
accuracy and held-out NLL are kept as `<attacker>_student_accuracy` and `<attacker>_student_holdout_loss` (sft
keeps the plain names). The plain teacher does not depend on λ: its student is trained once per temperature
and seed and shared by the points (at λ = 0 it is opd's too).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from datasets import Dataset

from opdkit.ads.sampler import sample_traces
from opdkit.ads.steering import Steering
from opdkit.ads.teacher import ADSTeacher
from opdkit.config import repeat_seeds
from opdkit.data import traces
from opdkit.jobs.antidistill import defences, findings
from opdkit.jobs.antidistill.config import ATTACKER_NAMES
from opdkit.jobs.antidistill.sweep import Point, Prepared
from opdkit.notebook.verdicts import pct
from opdkit.opd.teachers.defended import defended
from opdkit.rollout import engines
from opdkit.run.files import atomic_write_text, read_jsonl, write_jsonl
from opdkit.run.folders import RunDir, print0
from opdkit.run.spread import read_result, run_safely
from opdkit.sft import student as sft_student
from opdkit.tasks import evaluate

POINTS_DIR = "points"
POINT_FILE = "point.json"  # a finished (or failed) point: its summary entry
TRACES_FILE = "traces.jsonl"  # a point's traces, reused by resume=True when complete
BASELINE_FILE = "baseline.json"  # the student before distillation and the gradients' norms (process 0)
ON_POLICY = tuple(a for a in ATTACKER_NAMES if a != "sft")
OPD_DIR = "opd"  # points/<name>/seed<seed>/opd/: the ADS-scored student's trainer output and metrics.jsonl
PLAIN_DIR = "plain"  # plain/tau<τ>-seed<seed>/: the plain-scored student, shared by the points of that τ
PLAIN_FILE = "result.json"


@dataclass
class Held:
    """What a sweep process holds for its points: the steering, the gradient's holdout traces in the student's
    tokens, its device, the run."""

    steering: Steering
    holdout: list[dict]
    device: torch.device
    run: RunDir
    served: torch.nn.Module | None = None  # teacher_server: the attackers' teacher states come from there


def point_dir(run: RunDir, point: Point) -> Path:
    return run.path / POINTS_DIR / point.name


def finished(run: RunDir, point: Point) -> bool:
    result = read_result(point_dir(run, point) / POINT_FILE)
    return result is not None and result.get("status") == "done"


def point_result(point: Point, prep: Prepared, held: Held) -> dict:
    """`run_point`, its entry kept in points/<name>/point.json; an exception becomes a failed entry with its
    traceback (also in points/<name>/error.txt), and the models are put back for the next point."""
    return run_safely(
        point_dir(held.run, point) / POINT_FILE,
        lambda: run_point(point, prep, held),
        {**asdict(point), "name": point.name},
        lambda: held.steering.offload(False),
    )


def write_traces(prep: Prepared, held: Held, point: Point, seed: int) -> list[dict]:
    """The teacher answers every training prompt at this point; each record says whether its answer is
    right."""
    cfg, steering = prep.cfg, held.steering
    texts = sample_traces(
        steering.teacher,
        prep.teacher_tokenizer,
        prep.train_messages,
        direction=steering.direction(point.gradient) if point.gradient else None,
        lam=point.lam,
        temperature=point.temperature,
        seed=seed,  # the same noise at every point of a repeat: the sweeps differ only by λ and τ
        top_p=cfg.trace_top_p,
        top_k=cfg.trace_top_k,
        max_new_tokens=cfg.trace_max_new_tokens,
        batch_size=cfg.trace_batch_size,
        enable_thinking=cfg.enable_thinking,
        desc=f"traces {point.name}",
    )
    return [
        traces.trace(m, text, answer=a, correct=prep.task.check(text, a) if a else None, truncated=truncated)
        for m, a, (text, truncated) in zip(prep.train_messages, prep.train_answers, texts)
    ]


def saved_traces(path: Path, prep: Prepared) -> list[dict] | None:
    """A point's traces written by an earlier run, when they are complete: one record (`data.traces`'s
    layout) per training prompt, in order. None (with the reason said) when they must be written again."""
    if not path.is_file():
        return None
    records = read_jsonl(path)  # written atomically: the whole file or none
    problem = None
    if len(records) != len(prep.train_messages):
        problem = f"{len(records)} traces for {len(prep.train_messages)} training prompts"
    elif any(r.get("messages", [])[:-1] != m for r, m in zip(records, prep.train_messages)):
        problem = "their prompts are not this run's training prompts"
    if problem:
        print0(f"resume: writing the traces again, {path} does not fit ({problem})")
        return None
    print0(f"resume: reusing the {len(records)} traces in {path}")
    return records


def student_accuracies(model: torch.nn.Module, prep: Prepared) -> tuple[float, float]:
    """(raw, forced) greedy accuracy on the held-out problems: the completions as written, and with their
    final answers forced as the ADS reference does (`tasks.evaluate.accuracy`)."""
    args = (prep.student_tokenizer, prep.task, prep.eval_messages, prep.eval_answers)
    acc = evaluate.configured_accuracy(prep.cfg, model, *args, bf16=False)
    return acc.raw, acc.forced


def holdout_loss(model: torch.nn.Module, prep: Prepared, held: Held, batch_size: int) -> float | None:
    return sft_student.holdout_loss(model, held.holdout, prep.student_tokenizer.pad_token_id, batch_size)


def run_once(point: Point, seed: int, prep: Prepared, held: Held) -> dict:
    """Traces at this point, a fresh student distilled on them, both accuracies; in
    points/<name>/seed<seed>/."""
    cfg, dev, tok = prep.cfg, held.device, prep.student_tokenizer
    folder = point_dir(held.run, point) / f"seed{seed}"
    if cfg.resume and (folder / "result.json").is_file():
        print0(f"resume: reusing {folder / 'result.json'}")
        return json.loads((folder / "result.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    records = saved_traces(folder / TRACES_FILE, prep) if cfg.resume else None
    if records is None:
        records = write_traces(prep, held, point, seed)
        write_jsonl(folder / TRACES_FILE, records)
    held.steering.offload(True)
    student_seed = sft_student.sft_seed(cfg, seed)
    student = sft_student.fresh_student(cfg, dev, student_seed)
    rows = sft_student.sft_rows(records, tok, cfg)
    trainer = sft_student.distill(student, rows, cfg, tok, student_seed, folder, f"{point.name}-seed{seed}")
    student = sft_student.keep_student(trainer.model, cfg, tok, folder)
    steps = trainer.step_log()
    raw, forced = student_accuracies(student, prep)
    result = {
        "seed": seed,
        "teacher_accuracy": evaluate.fraction_correct(r["correct"] for r in records),
        "student_accuracy": raw,
        "student_accuracy_forced": forced,
        "student_holdout_loss": holdout_loss(
            student, prep, held, cfg.sft_micro_batch_size or cfg.sft_batch_size
        ),
        "truncated_fraction": sum(r["truncated"] for r in records) / len(records),
        "num_traces": len(records),
        "errors": prep.task.error_kinds(records),
        "sft_steps": trainer.state.global_step,
        "final_sft_loss": steps[-1]["loss"] if steps else None,
        "seconds": round(time.time() - t0, 1),
    }
    measures = ("teacher_accuracy", "student_accuracy", "student_accuracy_forced", "student_holdout_loss")
    trainer.log(
        {k: result[k] for k in measures if result[k] is not None}
    )  # to report_to, after the SFT steps
    # The SFT student (merged adapters, AdamW state) is not held while the attackers run: the plan's
    # on-policy stage has no room for it.
    del trainer, student
    engines.free_memory()
    result.update(run_attackers(point, seed, prep, held, folder))  # the on-policy attackers, if any
    write_jsonl(folder / "metrics.jsonl", steps)
    atomic_write_text(folder / "result.json", json.dumps(result, indent=2))
    held.steering.offload(False)
    return result


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def _mean_errors(values: list[dict | None]) -> dict[str, float] | None:
    kept = [v for v in values if v]
    return {k: sum(v[k] for v in kept) / len(kept) for k in kept[0]} if kept else None


def run_point(point: Point, prep: Prepared, held: Held) -> dict:
    """The point's `repeats` runs (`config.repeat_seeds`, as 02's and 03's repeats) and their mean accuracies:
    one summary entry."""
    runs = [run_once(point, seed, prep, held) for seed in repeat_seeds(prep.cfg)]
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


def baseline(prep: Prepared, held: Held) -> dict:
    """The student before any distillation, where every point starts from: accuracy and held-out loss."""
    cfg = prep.cfg
    student = sft_student.fresh_student(cfg, held.device, sft_student.sft_seed(cfg, cfg.seed))
    loss = holdout_loss(student, prep, held, cfg.sft_micro_batch_size or cfg.sft_batch_size)
    raw, forced = student_accuracies(student, prep)
    return {
        "student_accuracy_before": raw,
        "student_accuracy_before_forced": forced,
        "student_holdout_loss_before": loss,
    }


def result_key(attacker: str, measure: str = "student_accuracy") -> str:
    """Where an attacker's measure sits in a point's result: sft keeps the plain name (student_accuracy),
    the others are prefixed (opd_student_accuracy, opd_plain_student_accuracy)."""
    return measure if attacker == "sft" else f"{attacker.replace('-', '_')}_{measure}"


def scoring_teacher(
    attacker: str, point: Point, steering: Steering, served: torch.nn.Module | None = None
) -> ADSTeacher:
    """The teacher as the attacker's trainer sees it: the ADS distribution at the point's λ and τ (opd), or
    the plain one at τ (opd-plain); with `served` (`teacher_server`), the teacher's part of it from the
    server's states and its head (the proxies' Δ stays in process)."""
    lam = point.lam if attacker == "opd" else 0.0
    direction = steering.direction(point.gradient) if lam else None
    base = served if served is not None else steering.teacher
    return ADSTeacher(base, direction, lam, temperature=point.temperature)


def distill_on_policy(
    attacker: str, point: Point, seed: int, prep: Prepared, held: Held, folder: Path, defence: str = "none"
) -> dict:
    """One on-policy attacker at this point: a fresh student, 02's recipe (this config's `OPDSettings` and
    `OPDTraining`, one device, no checkpoints) with its scoring teacher (behind `defence`, a
    `teacher_defence`: what its loss reads of it), then its held-out accuracy and NLL."""
    from transformers import PrinterCallback  # the trainer's imports take seconds: not at a plan's

    from opdkit.opd.arguments import training_arguments
    from opdkit.opd.build import distill_trainer

    cfg, dev, t0 = prep.cfg, held.device, time.time()
    teacher = defended(scoring_teacher(attacker, point, held.steering, held.served).to(dev), defence, seed)
    student = sft_student.fresh_student(cfg, dev, sft_student.sft_seed(cfg, seed))
    rows = [{"messages": m, "answer": a} for m, a in zip(prep.train_messages, prep.train_answers)]
    args = training_arguments(
        cfg,
        str(folder),
        run_name=f"{point.name}-{attacker}{'' if defence == 'none' else '-' + defence}-seed{seed}",
        seed=seed,
        data_seed=seed,
        bf16=cfg.bf16 and dev.type == "cuda",
        use_cpu=dev.type != "cuda",
        save_strategy="no",
        sample_every=0,
        report_to=[],
        disable_tqdm=True,
    )
    dataset = Dataset.from_list(rows)
    trainer = distill_trainer(
        cfg, args, student, teacher, prep.student_tokenizer, dataset, teacher_tokenizer=prep.teacher_tokenizer
    )
    trainer.remove_callback(PrinterCallback)  # its log lines are metrics.jsonl's records
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    write_jsonl(folder / "metrics.jsonl", steps)
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()
    raw, forced = student_accuracies(model, prep)
    return {
        result_key(attacker): raw,
        result_key(attacker, "student_accuracy_forced"): forced,
        result_key(attacker, "student_holdout_loss"): holdout_loss(
            model, prep, held, cfg.per_device_train_batch_size
        ),
        result_key(attacker, "steps"): trainer.state.global_step,
        result_key(attacker, "final_loss"): steps[-1]["loss"] if steps else None,
        result_key(attacker, "seconds"): round(time.time() - t0, 1),
    }


def run_attackers(point: Point, seed: int, prep: Prepared, held: Held, folder: Path) -> dict:
    """The on-policy attackers `attackers` lists, at this point and seed (sft is the point's own SFT run).

    The plain teacher at τ is the same at every point of that τ (and is opd's at λ = 0), and everything else
    is seeded: that student is trained once per (τ, seed), in plain/tau<τ>-seed<seed>/ of the run, and its
    result reused by every point (and by resume)."""
    held.steering.offload(False)  # back from host memory if they waited there while the SFT student trained
    found: dict = {}
    for attacker in [a for a in ON_POLICY if a in prep.cfg.attackers]:
        if attacker == "opd" and point.lam != 0:
            found.update(distill_on_policy(attacker, point, seed, prep, held, folder / OPD_DIR))
        else:
            plain = plain_result(point, seed, prep, held)
            found.update({result_key(attacker, k): v for k, v in plain.items()})
        engines.free_memory()  # the attacker's student, trainer and scoring teacher, before the next
    if prep.cfg.defences and defences.is_control(point):
        found["defences"] = {d: defended_result(d, point, seed, prep, held) for d in prep.cfg.defences}
        found["defence_costs"] = defence_costs(seed, prep, held, folder)
    return found


def defended_result(defence: str, point: Point, seed: int, prep: Prepared, held: Held) -> dict:
    """The on-policy student of the plain teacher at τ 1 behind `defence`, at this seed (kept in
    defended/<defence>-seed<seed>/, reused by a resume): its accuracies, held-out NLL, steps, loss."""
    folder = held.run.path / defences.DEFENDED_DIR / defences.folder_name(defence, seed)
    if (folder / PLAIN_FILE).is_file():
        return json.loads((folder / PLAIN_FILE).read_text())
    found = distill_on_policy("opd-plain", point, seed, prep, held, folder, defence=defence)
    out = {k[len(result_key("opd-plain", "")) :]: v for k, v in found.items()}
    atomic_write_text(folder / PLAIN_FILE, json.dumps(out, indent=2))
    engines.free_memory()
    return out


def defence_costs(seed: int, prep: Prepared, held: Held, folder: Path) -> dict:
    """Each defence's cost to an honest user (`defences.serving_costs`), and the ADS distribution's at every
    λ of the sweep (τ 1), on the first traces of this (the control) point."""
    cfg, tok = prep.cfg, prep.student_tokenizer
    rows = sft_student.sft_rows(read_jsonl(folder / TRACES_FILE)[: defences.COST_TRACES], tok, cfg)
    ads = {
        findings.ads_label(lam): scoring_teacher("opd", Point("ads", lam, 1.0), held.steering)
        for lam in cfg.lams
        if lam != 0
    }
    teacher = held.steering.teacher
    return defences.serving_costs(
        cfg.defences, teacher, ads, rows, tok.pad_token_id, len(tok), held.device, seed
    )


def plain_result(point: Point, seed: int, prep: Prepared, held: Held) -> dict:
    """The on-policy student of the plain teacher at the point's τ and this seed, trained at most once."""
    folder = held.run.path / PLAIN_DIR / f"tau{point.temperature:g}-seed{seed}"
    if (folder / PLAIN_FILE).is_file():
        return json.loads((folder / PLAIN_FILE).read_text())
    found = distill_on_policy("opd-plain", point, seed, prep, held, folder)
    out = {k[len(result_key("opd-plain", "")) :]: v for k, v in found.items()}
    atomic_write_text(folder / PLAIN_FILE, json.dumps(out, indent=2))
    return out


def mean_over_runs(runs: list[dict]) -> dict:
    """Each on-policy attacker's accuracy and held-out NLL, as the mean over a point's runs."""
    out = {}
    for attacker in ON_POLICY:
        for measure in ("student_accuracy", "student_accuracy_forced", "student_holdout_loss"):
            key = result_key(attacker, measure)
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                out[key] = sum(values) / len(values)
    return out


def result_line(r: dict) -> str:
    """A finished point in one line, accuracies in percent (means over its runs)."""
    if r["status"] != "done":
        return f"{r['name']:28s} FAILED: {r['error'].strip().splitlines()[-1]}"
    return (
        f"{r['name']:28s} teacher {pct(r['teacher_accuracy'])}  student {pct(r['student_accuracy'])} "
        f"(forced {pct(r.get('student_accuracy_forced'))})  ({r['seconds']:.0f} s)"
    )


def gather(points: list[Point], run: RunDir, failure: str | None) -> dict:
    """The points' entries in sweep order from their folders, the failed ones apart (with their tracebacks;
    a point whose process died carries `failure`, the launcher's report), and the baseline; metrics.jsonl is
    rewritten from them: one record per finished point, then each student's SFT losses (`sft_loss`)."""
    done, failed = [], []
    for p in points:
        entry = read_result(point_dir(run, p) / POINT_FILE)
        if entry is None:
            entry = {**asdict(p), "name": p.name, "status": "failed", "error": failure or "not run"}
        (done if entry["status"] == "done" else failed).append(entry)
    records = [{k: v for k, v in e.items() if k != "runs"} for e in done]
    for e in done:
        for r in e["runs"]:
            steps = read_jsonl(run.path / POINTS_DIR / e["name"] / f"seed{r['seed']}" / "metrics.jsonl")
            records.append(
                {"point": e["name"], "seed": r["seed"], "sft_loss": [s["loss"] for s in steps if "loss" in s]}
            )
    atomic_write_text(run.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    before = (
        json.loads((run.path / BASELINE_FILE).read_text()) if (run.path / BASELINE_FILE).is_file() else {}
    )
    return {
        "status": "done" if not failed else "incomplete",
        "points": done,
        "failed_points": failed,
        **before,
    }
