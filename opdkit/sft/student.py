"""A student distilled by completion-only SFT on a teacher's traces: fresh (as loaded, or initialised from
scratch), LoRA through peft when asked, trained by `CompletionSFTTrainer`, saved, and its held-out NLL
measured. Its settings are `SFTSettings`, composed into a job's config (04's, whose students these are).

    model = fresh_student(cfg, device, seed)
    trainer = distill(model, rows, cfg, tokenizer, seed, folder)     # rows: sft_rows(traces, tokenizer, cfg)
    model = keep_student(trainer.model, cfg, tokenizer, folder)     # saved in folder/student/, LoRA merged
    nll = holdout_loss(model, rows, tokenizer.pad_token_id, batch_size=8)

`cfg` is a job's config: `SFTSettings` with `student_model`, `seed`, `bf16`, `gradient_checkpointing`,
`enable_thinking`, `report_to` and `resume` beside them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, PreTrainedTokenizerBase

from opdkit import memory, tiny
from opdkit.config import ConfigError
from opdkit.data import labels, traces
from opdkit.models import enable_activation_checkpointing
from opdkit.run import checkpoints
from opdkit.tasks.evaluate import completion_budget

if TYPE_CHECKING:  # transformers' Trainer takes seconds to import: the functions that train import it
    from transformers import TrainingArguments

    from opdkit.sft.trainer import CompletionSFTTrainer

SFT_DIR = "sft"  # the Trainer's output: checkpoints, tracker logs
STUDENT_DIR = "student"  # the final student (adapter or model) and its tokenizer


def fresh_student(cfg: Any, dev: torch.device, seed: int) -> torch.nn.Module:
    """The student as loaded, or (student_init=scratch) its architecture with weights drawn from `seed`."""
    from transformers import AutoModelForCausalLM

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


def sft_seed(cfg: Any, seed: int) -> int:
    """The SFT seed of the run with sampling seed `seed` (seed, seed+1, ... over repeats): `sft_seed` moved
    along the same way, or `seed` itself when `sft_seed` is -1."""
    return seed if cfg.sft_seed < 0 else cfg.sft_seed + (seed - cfg.seed)


def sft_rows(records: list[dict], tok: PreTrainedTokenizerBase, cfg: Any) -> list[dict]:
    """Each trace (`data.traces`'s records) in the student's own chat template (`traces.with_labels`):
    input_ids, labels (-100 outside the completion); a truncated trace without the end-of-turn tokens the
    template would append; cut at `sft_max_length` tokens; traces left with no completion token are
    dropped."""
    rows = []
    for rec in traces.with_labels(records, tok, cfg.enable_thinking):
        ids, labs = rec["input_ids"], rec["labels"]
        if cfg.sft_max_length:
            ids, labs = ids[: cfg.sft_max_length], labs[: cfg.sft_max_length]
        if any(t != labels.IGNORE for t in labs):
            rows.append({"input_ids": ids, "labels": labs})
    return rows


def sft_steps(cfg: Any, n_rows: int) -> int:
    if cfg.sft_max_steps >= 0:
        return cfg.sft_max_steps
    return max(1, math.ceil(cfg.sft_epochs * n_rows / cfg.sft_batch_size))


def training_arguments(
    cfg: Any, folder: Path, steps: int, seed: int, dev: torch.device, name: str = ""
) -> TrainingArguments:
    """The students' SFT recipe as `TrainingArguments`: AdamW, `round(sft_warmup_ratio * steps)` linear
    warmup steps then cosine, clipping at 1, `sft_batch_size` rows per step in micro-batches, one device, a
    log record every step; checkpoints (every `sft_checkpoint_every`) and tracker logs under `folder`/sft/."""
    from transformers import TrainingArguments

    micro = cfg.sft_micro_batch()
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
        save_strategy="steps" if cfg.sft_checkpoint_every else "no",
        save_steps=cfg.sft_checkpoint_every or steps,
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


def with_lora(model: torch.nn.Module, cfg: Any, seed: int) -> torch.nn.Module:
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


def distill(
    model: torch.nn.Module,
    rows: list[dict],
    cfg: Any,
    tok: PreTrainedTokenizerBase,
    seed: int,
    folder: Path,
    name: str = "",
) -> CompletionSFTTrainer:
    """Completion-only SFT on `Trainer` (`CompletionSFTTrainer`): the rows in `batch_order`, each step's loss
    the mean over all of its completion tokens; LoRA when `student_lora_r` > 0; with resume=True it continues
    from the newest complete checkpoint in `folder`/sft/, refused when that checkpoint trained on other rows
    (`trained_on_problem`). Returns the trainer (its `step_log()`, its `model` trained)."""
    from opdkit.sft.trainer import CompletionSFTTrainer, batch_order, trained_on_problem

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
        problem = trained_on_problem(last, rows)
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
    model: torch.nn.Module, cfg: Any, tok: PreTrainedTokenizerBase, folder: Path
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


def load_student(cfg: Any, folder: Path, seed: int, dev: torch.device) -> torch.nn.Module:
    """A saved student from `folder`/student/, ready to evaluate: the model, or the fresh student (`seed`, as
    trained) with the saved LoRA adapter merged in."""
    from transformers import AutoModelForCausalLM

    path = Path(folder) / STUDENT_DIR
    if not (path / "adapter_config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(dev).eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(fresh_student(cfg, dev, seed), path).merge_and_unload().eval()


@torch.no_grad()
def holdout_loss(
    model: torch.nn.Module, rows: list[dict], pad_token_id: int, batch_size: int
) -> float | None:
    """Mean over traces of each trace's mean completion NLL (savegrad's `trace` normalisation); None without
    rows."""
    if not rows:
        return None
    dev, total = next(model.parameters()).device, 0.0
    for batch in labels.make_batches(rows, list(range(len(rows))), batch_size, pad_token_id, dev):
        loss_sum_B, n_B = labels.token_losses(model, batch)
        total += float((loss_sum_B / n_B).sum())
    return total / len(rows)


def sft_stage(cfg: Any, budget: float | None) -> memory.Stage:
    """What one process holds while a student is distilled on traces (`sft_micro_batch` of them a forward
    pass, AdamW; a LoRA student's gradients and optimizer state are its adapters') and then evaluated greedily
    (`eval_batch_size`), for the memory plan."""
    gpu = budget is not None
    completion = cfg.trace_max_new_tokens
    if cfg.sft_max_length:
        completion = max(1, min(cfg.trace_max_new_tokens, cfg.sft_max_length - cfg.max_prompt_length))
    student = memory.ModelShape.from_config(cfg.student_model)
    return memory.Stage(
        student=student,
        student_dtype="float32",
        bf16=cfg.bf16 and gpu,
        device="cuda" if gpu else "cpu",
        optimizer="adamw",
        trainable_params=student.lora_params(cfg.student_lora_r, cfg.student_lora_target_modules),
        gradient_checkpointing=cfg.gradient_checkpointing,
        train_batch_size=cfg.sft_micro_batch(),
        prompt_len=cfg.max_prompt_length,
        completion_len=completion,
        eval_model="student",
        eval_bf16=False,  # 04 evaluates its students in fp32 (`jobs.antidistill.points.student_accuracies`)
        eval_batch_size=cfg.eval_batch_size,
        eval_completion_len=completion_budget(cfg),
    )
