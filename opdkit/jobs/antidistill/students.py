"""The students of antidistill: a fresh one per point, distilled on the point's traces by completion-only
SFT on transformers' `Trainer` (`sft.CompletionSFTTrainer`; LoRA through peft when `student_lora_r` > 0),
saved, then measured: greedy accuracy on held-out problems, and the NLL on the gradient's held-out traces (the
objective ADS steers by).

    trainer = distill_student(fresh_student(cfg, dev, seed), rows, cfg, tok, seed, folder)
    model = keep_student(trainer.model, cfg, tok, folder)       # saved in folder/student/, LoRA merged
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase, TrainingArguments

from opdkit import tiny
from opdkit.config import ConfigError
from opdkit.data import sft, traces
from opdkit.data.sft import CompletionSFTTrainer
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.antidistill.sweep import Prepared
from opdkit.models import enable_activation_checkpointing
from opdkit.rollout import evaluate
from opdkit.run import checkpoints
from opdkit.run.folders import print0

SFT_DIR = "sft"  # the Trainer's output: checkpoints, tracker logs
STUDENT_DIR = "student"  # the final student (adapter or model) and its tokenizer
HOLDOUT_LOSS_TRACES = 256  # the first traces of the gradient's holdout, enough for a steady mean


def fresh_student(cfg: AntidistillConfig, dev: torch.device, seed: int) -> torch.nn.Module:
    """The student as loaded, or (student_init=scratch) its architecture with weights drawn from `seed`."""
    name = tiny.resolve(cfg.student_model)
    torch.manual_seed(seed)
    if cfg.student_init == "scratch":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name))
    else:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
        model.config.use_cache = False
    return model.to(dev)


def sft_seed(cfg: AntidistillConfig, seed: int) -> int:
    """The SFT seed of the run with sampling seed `seed` (seed, seed+1, ... over repeats): `sft_seed` moved
    along the same way, or `seed` itself when `sft_seed` is -1."""
    return seed if cfg.sft_seed < 0 else cfg.sft_seed + (seed - cfg.seed)


def sft_rows(records: list[dict], tok: PreTrainedTokenizerBase, cfg: AntidistillConfig) -> list[dict]:
    """Each trace in the student's own chat template: input_ids, labels (-100 outside the completion); a
    truncated trace without the end-of-turn tokens the template would append."""
    rows = []
    for rec in records:
        conversation = [*rec["messages"], {"role": "assistant", "content": rec["completion"]}]
        ids, labels = sft.completion_labels(
            tok, conversation, cfg.enable_thinking, bool(rec.get("truncated"))
        )
        if cfg.sft_max_length:
            ids, labels = ids[: cfg.sft_max_length], labels[: cfg.sft_max_length]
        if any(t != sft.IGNORE for t in labels):
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def sft_steps(cfg: AntidistillConfig, n_rows: int) -> int:
    if cfg.sft_max_steps >= 0:
        return cfg.sft_max_steps
    return max(1, math.ceil(cfg.sft_epochs * n_rows / cfg.sft_batch_size))


def batch_order(n_rows: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Row indices of every step: epochs of seeded shuffles, cut into batches (an epoch may span two
    steps)."""
    rng, pool, out = random.Random(seed), [], []
    for _ in range(steps):
        while len(pool) < batch_size:
            epoch = list(range(n_rows))
            rng.shuffle(epoch)
            pool += epoch
        out.append(pool[:batch_size])
        del pool[:batch_size]
    return out


def training_arguments(
    cfg: AntidistillConfig, folder: Path, steps: int, seed: int, dev: torch.device, name: str = ""
) -> TrainingArguments:
    """The students' SFT recipe as `TrainingArguments`: AdamW, `round(sft_warmup_ratio * steps)` linear
    warmup steps then cosine, clipping at 1, `sft_batch_size` rows per step in micro-batches, one device, a
    log record every step; checkpoints (every `sft_save_steps`) and tracker logs under `folder`/sft/."""
    micro = min(cfg.sft_micro_batch_size or cfg.sft_batch_size, cfg.sft_batch_size)
    args = TrainingArguments(
        output_dir=str(folder / SFT_DIR),
        max_steps=steps,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=math.ceil(cfg.sft_batch_size / micro),
        learning_rate=cfg.sft_learning_rate,
        weight_decay=cfg.sft_weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=round(cfg.sft_warmup_ratio * steps),
        max_grad_norm=1.0,
        bf16=cfg.bf16 and dev.type == "cuda",
        seed=seed,
        data_seed=seed,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="steps" if cfg.sft_save_steps else "no",
        save_steps=cfg.sft_save_steps or steps,
        save_total_limit=1,
        report_to=cfg.report_to,
        run_name=name or None,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        use_cpu=dev.type != "cuda",
    )
    _ = args.device
    args._n_gpu = min(args._n_gpu, 1)  # one student, one device: never DataParallel over the node's GPUs
    return args


def with_lora(model: torch.nn.Module, cfg: AntidistillConfig, seed: int) -> torch.nn.Module:
    """The student with LoRA adapters on `student_lora_target_modules` (peft), or as it is when the rank
    is 0."""
    if not cfg.student_lora_r:
        return model
    from peft import LoraConfig, get_peft_model

    targets = cfg.student_lora_target_modules
    targets = targets[0] if targets == ["all-linear"] else targets  # peft's own keyword
    lora = LoraConfig(
        r=cfg.student_lora_r,
        lora_alpha=cfg.student_lora_alpha or cfg.student_lora_r,
        lora_dropout=cfg.student_lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
    )
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    torch.manual_seed(seed)  # the adapters' initialisation
    return get_peft_model(model, lora)


def distill_student(
    model: torch.nn.Module,
    rows: list[dict],
    cfg: AntidistillConfig,
    tok: PreTrainedTokenizerBase,
    seed: int,
    folder: Path,
    name: str = "",
) -> CompletionSFTTrainer:
    """Completion-only SFT on `Trainer` (`sft.CompletionSFTTrainer`): the rows in `batch_order`, each step's
    loss the mean over all of its completion tokens; LoRA when `student_lora_r` > 0; with resume=True it
    continues from the newest complete checkpoint in `folder`/sft/, refused when that checkpoint
    trained on other rows (`sft.trained_on_problem`). Returns the trainer (its `step_log()`, its `model`
    trained)."""
    steps = sft_steps(cfg, len(rows))
    model = with_lora(model, cfg, seed)
    args = training_arguments(cfg, folder, steps, seed, next(model.parameters()).device, name)
    trainer = CompletionSFTTrainer(
        model=model,
        args=args,
        train_dataset=rows,
        processing_class=tok,
        order=batch_order(len(rows), cfg.sft_batch_size, steps, seed),
        pad_token_id=tok.pad_token_id,
    )
    last = (
        checkpoints.resume_checkpoint(args.output_dir, checkpoints.trainer_layout(trainer))
        if cfg.resume
        else None
    )
    if last is not None:
        problem = sft.trained_on_problem(last, rows)
        if problem:
            raise ConfigError(
                f"resume refused: {problem}. Continuing it would train one student on two sets of traces. "
                f"Delete {args.output_dir} to distil this student again from the traces beside it, or "
                "restore the traces it was trained on."
            )
    trainer.train(resume_from_checkpoint=str(last) if last else None)
    trainer.model.eval()
    return trainer


def keep_student(
    model: torch.nn.Module, cfg: AntidistillConfig, tok: PreTrainedTokenizerBase, folder: Path
) -> torch.nn.Module:
    """Save the trained student as `student_save` says in `folder`/student/; returns the model to evaluate (a
    LoRA student with its adapter merged into the weights)."""
    out, lora = folder / STUDENT_DIR, bool(cfg.student_lora_r)
    if cfg.student_save == "adapter" or (cfg.student_save == "merged" and not lora):
        model.save_pretrained(out)
    if lora:
        model = model.merge_and_unload()
        if cfg.student_save == "merged":
            model.save_pretrained(out)
    if cfg.student_save != "none":
        tok.save_pretrained(out)
    return model


def load_student(cfg: AntidistillConfig, folder: Path, seed: int, dev: torch.device) -> torch.nn.Module:
    """A saved student from `folder`/student/, ready to evaluate: the model, or the fresh student (`seed`, as
    trained) with the saved LoRA adapter merged in."""
    path = Path(folder) / STUDENT_DIR
    if not (path / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(fresh_student(cfg, dev, seed), path).merge_and_unload().eval()


def student_accuracies(model: torch.nn.Module, prep: Prepared) -> tuple[float, float]:
    """(raw, forced) greedy accuracy on the held-out problems: the completions as written, and with their
    final answers forced as the ADS reference does (`evaluate.forced_completions`)."""
    cfg = prep.cfg
    return evaluate.accuracies(
        model,
        prep.student_tokenizer,
        prep.eval_messages,
        prep.eval_answers,
        prep.task,
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens,
        batch_size=cfg.gen_batch_size,
        enable_thinking=cfg.enable_thinking,
    )


def holdout_rows(grads_dir: Path, tok: PreTrainedTokenizerBase, cfg: AntidistillConfig) -> list[dict]:
    """The traces the proxy gradient was computed on, in the student's tokens: ADS's own objective is the
    mean completion NLL on them, which `holdout_loss` measures for a distilled student. None without
    traces/."""
    if not (Path(grads_dir) / traces.TRACES_DIR).is_dir():
        print0(f"{grads_dir} keeps no traces/: the students' held-out loss is not measured")
        return []
    held = traces.load_traces(grads_dir)
    held = held.select(range(min(len(held), HOLDOUT_LOSS_TRACES)))
    return sft_rows(
        [{"messages": m[:-1], "completion": m[-1]["content"]} for m in held["messages"]], tok, cfg
    )


@torch.no_grad()
def holdout_loss(
    model: torch.nn.Module, rows: list[dict], pad_token_id: int, batch_size: int
) -> float | None:
    """Mean over traces of each trace's mean completion NLL (savegrad's `trace` normalisation)."""
    if not rows:
        return None
    dev, total = next(model.parameters()).device, 0.0
    for batch in sft.make_batches(rows, list(range(len(rows))), batch_size, pad_token_id, dev):
        loss_sum_B, n_B = sft.token_losses(model, batch)
        total += float((loss_sum_B / n_B).sum())
    return total / len(rows)
