"""The students of 04_antidistill: a fresh one per point, distilled on the point's traces by completion-only
SFT, then measured: greedy accuracy on held-out problems, and the NLL on the gradient's held-out traces
(the objective ADS steers by).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from opdkit import evaluate, sft, tiny, traces
from opdkit.config import AntidistillationConfig
from opdkit.jobs.antidistill.sweep import Prepared
from opdkit.models import enable_activation_checkpointing
from opdkit.runs import print0

HOLDOUT_LOSS_TRACES = 256  # the first traces of the gradient's holdout, enough for a steady mean


def fresh_student(cfg: AntidistillationConfig, dev: torch.device, seed: int) -> torch.nn.Module:
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


def sft_seed(cfg: AntidistillationConfig, seed: int) -> int:
    """The SFT seed of the run with sampling seed `seed` (seed, seed+1, ... over repeats): `sft_seed` moved
    along the same way, or `seed` itself when `sft_seed` is -1."""
    return seed if cfg.sft_seed < 0 else cfg.sft_seed + (seed - cfg.seed)


def sft_rows(records: list[dict], tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig) -> list[dict]:
    """Each trace in the student's own chat template: input_ids, labels (-100 outside the completion); a
    truncated trace without the end-of-turn tokens the template would append."""
    rows = []
    for rec in records:
        ids, labels = sft.completion_labels(
            tok, [*rec["messages"], {"role": "assistant", "content": rec["completion"]}], cfg.enable_thinking
        )
        if rec.get("truncated"):  # the teacher never ended this turn: the student is not taught to end it
            ids, labels = sft.without_end_of_turn(tok, ids, labels)
        if cfg.sft_max_length:
            ids, labels = ids[: cfg.sft_max_length], labels[: cfg.sft_max_length]
        if any(t != sft.IGNORE for t in labels):
            rows.append({"input_ids": ids, "labels": labels})
    return rows


def sft_steps(cfg: AntidistillationConfig, n_rows: int) -> int:
    if cfg.sft_max_steps >= 0:
        return cfg.sft_max_steps
    return max(1, math.ceil(cfg.sft_epochs * n_rows / cfg.sft_batch_size))


def batch_order(n_rows: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """Row indices of every step: epochs of seeded shuffles, cut into batches (an epoch may span two steps)."""
    rng, pool, out = random.Random(seed), [], []
    for _ in range(steps):
        while len(pool) < batch_size:
            epoch = list(range(n_rows))
            rng.shuffle(epoch)
            pool += epoch
        out.append(pool[:batch_size])
        del pool[:batch_size]
    return out


def distill_student(
    model: torch.nn.Module, rows: list[dict], cfg: AntidistillationConfig, pad_token_id: int, seed: int,
    desc: str = "sft",
) -> list[float]:
    """Completion-only SFT (`sft.train_sft`): AdamW, linear warmup then cosine, gradient clipping at 1, the
    step's micro-batches summed so that each step's loss is the mean over all of its completion tokens.
    Returns the loss of every step."""
    steps = sft_steps(cfg, len(rows))
    dev, micro = next(model.parameters()).device, cfg.sft_micro_batch_size or cfg.sft_batch_size
    order = batch_order(len(rows), cfg.sft_batch_size, steps, seed)

    def micro_batches(step: int) -> list[dict]:
        idx = order[step]
        return [next(sft.make_batches(rows, idx[s : s + micro], micro, pad_token_id, dev)) for s in range(0, len(idx), micro)]

    losses, _ = sft.train_sft(
        model, micro_batches, steps, cfg.sft_learning_rate, warmup_steps=round(cfg.sft_warmup_ratio * steps),
        weight_decay=cfg.sft_weight_decay, bf16=cfg.bf16, desc=desc,
    )  # fmt: skip
    return losses


def student_accuracy(model: torch.nn.Module, prep: Prepared) -> float:
    cfg = prep.cfg
    return evaluate.accuracy(
        model, prep.student_tokenizer, prep.eval_messages, prep.eval_answers, prep.task.check,
        max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, batch_size=cfg.gen_batch_size,
        enable_thinking=cfg.enable_thinking,
    )  # fmt: skip


def holdout_rows(grads_dir: Path, tok: PreTrainedTokenizerBase, cfg: AntidistillationConfig) -> list[dict]:
    """The traces the proxy gradient was computed on, in the student's tokens: ADS's own objective is the
    mean completion NLL on them, which `holdout_loss` measures for a distilled student. None without traces/."""
    if not (Path(grads_dir) / traces.TRACES_DIR).is_dir():
        print0(f"{grads_dir} keeps no traces/: the students' held-out loss is not measured")
        return []
    held = traces.load_traces(grads_dir)
    held = held.select(range(min(len(held), HOLDOUT_LOSS_TRACES)))
    return sft_rows([{"messages": m[:-1], "completion": m[-1]["content"]} for m in held["messages"]], tok, cfg)


@torch.no_grad()
def holdout_loss(model: torch.nn.Module, rows: list[dict], pad_token_id: int, batch_size: int) -> float | None:
    """Mean over traces of each trace's mean completion NLL (01_save_grad's `trace` normalisation)."""
    if not rows:
        return None
    dev, total = next(model.parameters()).device, 0.0
    for batch in sft.make_batches(rows, list(range(len(rows))), batch_size, pad_token_id, dev):
        loss_sum_B, n_B = sft.token_losses(model, batch)
        total += float((loss_sum_B / n_B).sum())
    return total / len(rows)
