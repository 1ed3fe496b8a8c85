"""The attackers of antidistill: who distils the teacher at each point of the trade-off.

    sft        a fresh student fine-tuned on the teacher's traces at the point (the ADS paper's attacker)
    opd        a fresh student distilled on-policy by 02's `DistillTrainer`: it samples its own completions
               and the teacher scores them with the distribution it samples from at the point,
               (z_teacher + λ·Δ) / τ (`ADSTeacher`); it never sees the traces
    opd-plain  the same, the teacher scoring with its plain log-probs at τ, λ = 0 (the control: ADS changes
               only what the teacher samples, and this attacker reads no sample)

    found = run_attackers(point, seed, prep, models, folder, dev)   # {"opd_student_accuracy": ..., ...}

Each on-policy student starts from the same fresh student as SFT's (`fresh_student`, the run's SFT seed) and
trains `opd_max_steps` steps of `opd_batch_size` of the training prompts, reverse KL (β = 1), clipped at 1,
rollouts at temperature 1 and `max_new_tokens`; its greedy held-out accuracy and the held-out NLL are kept
as `<attacker>_student_accuracy` and `<attacker>_student_holdout_loss` (sft keeps today's names). The plain
teacher does not depend on λ: its student is trained once per temperature and seed and shared by the points
(at λ = 0 it is opd's too).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PrinterCallback

from opdkit.ads.teacher import ADSTeacher
from opdkit.data import prompts
from opdkit.jobs.antidistill.config import ATTACKER_NAMES, AntidistillConfig
from opdkit.jobs.antidistill.steering import Models
from opdkit.jobs.antidistill.students import fresh_student, holdout_loss, sft_seed, student_accuracies
from opdkit.jobs.antidistill.sweep import Point, Prepared
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.run.files import atomic_write_text, write_jsonl
from opdkit.run.folders import RunDir

ON_POLICY = tuple(a for a in ATTACKER_NAMES if a != "sft")
OPD_DIR = "opd"  # points/<name>/seed<seed>/opd/: the ADS-scored student's trainer output and metrics.jsonl
PLAIN_DIR = "plain"  # plain/tau<τ>-seed<seed>/: the plain-scored student, shared by the points of that τ
PLAIN_FILE = "result.json"


def result_key(attacker: str, measure: str = "student_accuracy") -> str:
    """Where an attacker's measure sits in a point's result: sft keeps the plain name (student_accuracy),
    the others are prefixed (opd_student_accuracy, opd_plain_student_accuracy)."""
    return measure if attacker == "sft" else f"{attacker.replace('-', '_')}_{measure}"


def scoring_teacher(attacker: str, point: Point, models: Models) -> ADSTeacher:
    """The teacher as the attacker's trainer sees it: the ADS distribution at the point's λ and τ (opd), or
    the plain one at τ (opd-plain)."""
    lam = point.lam if attacker == "opd" else 0.0
    direction = models.direction(point.gradient) if lam else None
    return ADSTeacher(models.teacher, direction, lam, temperature=point.temperature)


def opd_arguments(cfg: AntidistillConfig, folder: Path, seed: int, dev: torch.device) -> OPDArguments:
    """02's recipe at the attacker's budget: reverse KL on the student's own rollouts (temperature 1),
    AdamW at a constant `opd_learning_rate`, clipping at 1, the kit's sampling loop, one device."""
    return OPDArguments(
        output_dir=str(folder),
        max_steps=cfg.opd_max_steps,
        per_device_train_batch_size=cfg.opd_batch_size,
        learning_rate=cfg.opd_learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=1.0,
        kl_temperature=1.0,
        gen_temperature=1.0,
        gen_top_p=1.0,
        max_new_tokens=cfg.max_new_tokens,
        rollout_engine="hf",
        sample_every=0,
        save_strategy="no",
        logging_steps=1,
        report_to=[],
        seed=seed,
        data_seed=seed,
        bf16=cfg.bf16 and dev.type == "cuda",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=dev.type != "cuda",
        disable_tqdm=True,
    )


def distill_on_policy(
    attacker: str, point: Point, seed: int, prep: Prepared, models: Models, folder: Path, dev: torch.device
) -> dict:
    """One on-policy attacker at this point: a fresh student, `opd_max_steps` steps of `DistillTrainer` with
    its scoring teacher, then its held-out accuracy and NLL."""
    cfg, t0 = prep.cfg, time.time()
    teacher = scoring_teacher(attacker, point, models).to(dev)
    student = fresh_student(cfg, dev, sft_seed(cfg, seed))
    rows = [{"messages": m, "answer": a} for m, a in zip(prep.train_messages, prep.train_answers)]
    trainer = DistillTrainer(
        model=student,
        args=opd_arguments(cfg, folder, seed, dev),
        train_dataset=Dataset.from_list(rows),
        data_collator=prompts.PromptCollator(
            prep.student_tokenizer, cfg.max_prompt_length, cfg.enable_thinking
        ),
        processing_class=prep.student_tokenizer,
        teacher_model=teacher,
        teacher_tokenizer=prep.teacher_tokenizer,
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
            model, models.holdout, prep.student_tokenizer.pad_token_id, cfg.opd_batch_size
        ),
        result_key(attacker, "steps"): trainer.state.global_step,
        result_key(attacker, "final_loss"): steps[-1]["loss"] if steps else None,
        result_key(attacker, "seconds"): round(time.time() - t0, 1),
    }


def run_attackers(
    point: Point, seed: int, prep: Prepared, models: Models, run: RunDir, folder: Path, dev: torch.device
) -> dict:
    """The on-policy attackers `attackers` lists, at this point and seed (sft is the point's own SFT run).

    The plain teacher at τ is the same at every point of that τ (and is opd's at λ = 0), and everything else
    is seeded: that student is trained once per (τ, seed), in plain/tau<τ>-seed<seed>/ of the run, and its
    result reused by every point (and by resume)."""
    models.teacher.to(dev)  # back from CPU memory if they waited there while the SFT student trained
    for direction in models.directions.values():
        direction.to(dev)
    found: dict = {}
    for attacker in [a for a in ON_POLICY if a in prep.cfg.attackers]:
        if attacker == "opd" and point.lam != 0:
            found.update(distill_on_policy(attacker, point, seed, prep, models, folder / OPD_DIR, dev))
            continue
        plain = plain_result(point, seed, prep, models, run, dev)
        found.update({result_key(attacker, k): v for k, v in plain.items()})
    return found


def plain_result(
    point: Point, seed: int, prep: Prepared, models: Models, run: RunDir, dev: torch.device
) -> dict:
    """The on-policy student of the plain teacher at the point's τ and this seed, trained at most once."""
    folder = run.path / PLAIN_DIR / f"tau{point.temperature:g}-seed{seed}"
    if (folder / PLAIN_FILE).is_file():
        return json.loads((folder / PLAIN_FILE).read_text())
    found = distill_on_policy("opd-plain", point, seed, prep, models, folder, dev)
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
