"""Completion-only supervised fine-tuning: `train_sft`, a plain loop with early stopping (the tiny world's
recipe), and `CompletionSFTTrainer`, the same objective on transformers' `Trainer` (the students of
antidistill: checkpoints, LoRA through peft, `report_to`).

    batch = sft_batch(tokenizer, messages)            # chat-templated, labels -100 outside completions
    losses, history = train_sft(model, lambda step: [batch], steps=100, lr=3e-3)
    trainer = CompletionSFTTrainer(model=m, args=TrainingArguments(...), train_dataset=rows, order=order,
                                   pad_token_id=tok.pad_token_id); trainer.train(); trainer.step_losses
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    get_cosine_schedule_with_warmup,
)
from transformers.trainer_callback import ProgressCallback

from opdkit.run.files import atomic_write_text

IGNORE = -100
TRAINED_ON_FILE = "trained_on.sha256"  # in each checkpoint of a CompletionSFTTrainer: its rows' hash


def completion_labels(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    enable_thinking: bool = False,
    truncated: bool = False,
) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one conversation; labels are -100 outside the assistant's turns. A `truncated`
    conversation (its writer ran out of tokens) keeps no end-of-turn target the template appends
    (`without_end_of_turn`): nothing teaches a learner to end a turn its writer never ended.

    The completion is found from the chat template's own `{% generation %}` markers when it has them,
    else from the prefix the template renders for the final assistant turn. No model-specific
    response marker is ever hard-coded.
    """
    enc = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        enable_thinking=enable_thinking,
    )
    ids = list(enc["input_ids"])
    mask = list(enc.get("assistant_masks") or [])
    if not any(mask):
        mask = _mask_from_prefix(tokenizer, messages, ids, enable_thinking)
    labels = [t if m else IGNORE for t, m in zip(ids, mask)]
    return without_end_of_turn(tokenizer, ids, labels) if truncated else (ids, labels)


def without_end_of_turn(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], labels: list[int]
) -> tuple[list[int], list[int]]:
    """A truncated completion as the teacher wrote it: the end-of-turn tokens the chat template appends after
    the completion (Qwen's <|im_end|>, an EOS) are cut, with everything after them, so no loss target is a
    token the teacher never wrote. Unchanged when nothing is labelled."""
    stops = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    labelled = [k for k, t in enumerate(labels) if t != IGNORE]
    if not labelled:
        return ids, labels
    end = labelled[-1]
    while end >= labelled[0] and labels[end] in stops:
        end -= 1
    return ids[: end + 1], labels[: end + 1]


def _mask_from_prefix(tokenizer, messages, ids, enable_thinking) -> list[int]:
    """Mask for templates without generation markers: everything after the rendered prompt."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("the last message must be the assistant's completion; got no assistant turn.")
    prompt = tokenizer.apply_chat_template(
        messages[:-1],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=True,
        enable_thinking=enable_thinking,
    )["input_ids"]
    n = len(prompt)
    if list(ids[:n]) != list(prompt):
        raise ValueError(
            "the chat template renders the prompt differently with and without the completion, so "
            "the completion cannot be located; use a template with {% generation %} markers."
        )
    # The template may append text after the assistant's end-of-turn token (e.g. a newline): the
    # completion ends at the last EOS or other special token. Not only the EOS: a base model's
    # tokenizer (Qwen2.5-3B: EOS <|endoftext|>) may use a chat template whose turns end with <|im_end|>.
    stops = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    end = len(ids)
    if any(t in stops for t in ids[n:]):
        end = n + max(i for i, t in enumerate(ids[n:]) if t in stops) + 1
    return [0] * n + [1] * (end - n) + [0] * (len(ids) - end)


def right_pad_batch(
    rows: list[tuple[list[int], list[int]]], pad_token_id: int, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attn[i, : len(ids)] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": attn.to(device), "labels": labels.to(device)}


def make_batches(
    rows: Sequence[dict],
    indices: Sequence[int],
    batch_size: int,
    pad_token_id: int,
    device: torch.device | str,
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches of consecutive `indices` (sorted by length, so padding stays small)."""
    for s in range(0, len(indices), batch_size):
        ids = list(indices[s : s + batch_size])
        batch = right_pad_batch(
            [(rows[i]["input_ids"], rows[i]["labels"]) for i in ids], pad_token_id, device
        )
        yield {**batch, "trace_ids": torch.tensor(ids)}


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion-token loss per trace, completion tokens per trace), both of shape B.

    Per-token cross-entropy over shifted logits with `reduction="none"`: padded and prompt positions
    carry label -100 and contribute exactly zero, whatever the batch looks like.
    """
    logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t+1: shift the labels, not the logits, whose shifted copy would be the
    # largest tensor of the step at a 151k vocabulary. The last position predicts nothing (-100).
    labels_BT = shifted_labels(batch["labels"])
    loss_N = F.cross_entropy(
        logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE, reduction="none"
    )
    return loss_N.view_as(labels_BT).sum(dim=1), (labels_BT != IGNORE).sum(dim=1)


def shifted_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (position t predicts token t+1); the last predicts nothing."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE)


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    enable_thinking: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    rows = [completion_labels(tokenizer, c, enable_thinking) for c in conversations]
    return right_pad_batch(rows, tokenizer.pad_token_id, device)


def train_sft(
    model: PreTrainedModel,
    next_batch: Callable[[int], list[dict[str, torch.Tensor]]],
    steps: int,
    lr: float,
    *,
    warmup_steps: int = 0,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    max_grad_norm: float = 1.0,
    bf16: bool = False,
    evaluate: Callable[[int], float] | None = None,
    eval_every: int = 0,
    stop_when: Callable[[float], bool] | None = None,
    desc: str = "sft",
) -> tuple[list[float], list[dict]]:
    """Completion-only SFT: AdamW, linear warmup then cosine decay (transformers' schedule), gradient
    clipping; returns (every step's loss, the evaluation history).

    `next_batch(step)` gives the step's micro-batches (right-padded, labels -100 outside completions);
    their summed token losses are divided by all of the step's completion tokens, so the loss is the
    token mean of the whole step whatever the micro-batch size. Every `eval_every` steps `evaluate(step)`
    is called and training stops early once `stop_when(value)` is true. `bf16` autocasts on CUDA.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
    sched = get_cosine_schedule_with_warmup(opt, warmup_steps, steps)
    dev = next(model.parameters()).device
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16 and dev.type == "cuda")
    losses: list[float] = []
    history: list[dict] = []
    model.train()
    bar = tqdm(range(steps), desc=desc, leave=False)
    for step in bar:
        micro = next_batch(step)
        n_tokens = sum(int((shifted_labels(b["labels"]) != IGNORE).sum()) for b in micro)
        total = 0.0
        for batch in micro:
            with autocast:
                loss_sum_B, _ = token_losses(model, batch)
            loss = loss_sum_B.sum() / max(n_tokens, 1)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        bar.set_postfix(loss=f"{total:.3f}")
        if evaluate and eval_every and (step + 1) % eval_every == 0:
            value = evaluate(step + 1)
            model.train()
            history.append({"step": step + 1, "loss": total, "eval": value})
            bar.set_postfix(loss=f"{total:.3f}", eval=f"{value:.3f}")
            if stop_when and stop_when(value):
                break
    model.eval()
    return losses, history


class StepBatches(torch.utils.data.Sampler):
    """A batch sampler that yields each step's rows in micro-batches of at most `micro` rows, in the order
    given (`order[step]`, e.g. antidistill's `batch_order`), so the Trainer sees exactly the kit's
    batches."""

    def __init__(self, order: Sequence[Sequence[int]], micro: int):
        self.batches = [list(idx[s : s + micro]) for idx in order for s in range(0, len(idx), micro)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def rows_sha256(rows: Sequence[dict]) -> str:
    """sha256 of SFT rows' input_ids and labels, in order: what a student trained on, exactly."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([list(row["input_ids"]), list(row["labels"])]).encode() + b"\n")
    return digest.hexdigest()


def trained_on_problem(checkpoint: str | Path, rows: Sequence[dict]) -> str | None:
    """Why resuming `checkpoint` (a `CompletionSFTTrainer` checkpoint) on `rows` would mix two trainings:
    its `TRAINED_ON_FILE` is missing or names other rows; None when it trained on these rows."""
    path = Path(checkpoint) / TRAINED_ON_FILE
    if not path.is_file():
        return f"{checkpoint} records no hash of the rows it trained on (no {TRAINED_ON_FILE})"
    recorded, now = path.read_text().strip(), rows_sha256(rows)
    if recorded != now:
        return (
            f"{checkpoint} trained on rows with sha256 {recorded[:12]}..., but the rows given now hash to "
            f"{now[:12]}...: the traces changed since it was saved"
        )
    return None


class CompletionSFTTrainer(Trainer):
    """Completion-only SFT on transformers' `Trainer`, the same objective as `train_sft`: each optimizer
    step's summed completion-token losses divided by all of the step's completion tokens
    (`num_items_in_batch`), so the loss is the token mean of the step whatever the micro-batch size; rows in
    the order of `order` (per step, row indices of `train_dataset`, a list of {input_ids, labels}) in
    micro-batches of `args.per_device_train_batch_size`, with `args.gradient_accumulation_steps` =
    micro-batches per step.

    Differences from `train_sft`: the Trainer's AdamW leaves biases and norm weights undecayed (as TRL's
    SFTTrainer, the ADS reference's), and `bf16` is the Trainer's mixed precision. `step_losses` holds every
    step's loss unrounded; checkpoints, `report_to`, LoRA (a peft model) are the Trainer's own."""

    def __init__(self, *args, order: Sequence[Sequence[int]], pad_token_id: int, **kwargs):
        kwargs.setdefault("data_collator", functools.partial(_collate, pad_token_id=pad_token_id))
        super().__init__(*args, **kwargs)
        micro = self.args.per_device_train_batch_size
        if any(-(-len(idx) // micro) != self.args.gradient_accumulation_steps for idx in order):
            raise ValueError(
                f"every step must have gradient_accumulation_steps={self.args.gradient_accumulation_steps} "
                f"micro-batches of up to {micro} rows; set it to ceil(step rows / micro-batch rows)."
            )
        self.order, self.step_losses, self._step_loss = order, [], 0.0
        self.rows_sha256 = rows_sha256(self.train_dataset)
        self.model_accepts_loss_kwargs = True  # compute_loss divides by num_items_in_batch itself
        self.add_callback(_StepLoss(self))
        if self.pop_callback(ProgressCallback):  # the bar without a printed dict per step
            self.add_callback(_QuietProgress())

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' checkpoint, which first gets `TRAINED_ON_FILE`, the hash of the rows it trains on:
        written before `trainer_state.json`, so every complete checkpoint has it."""
        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / TRAINED_ON_FILE, self.rows_sha256 + "\n")
        super()._save_checkpoint(model, trial)

    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        sampler = StepBatches(self.order, self.args.per_device_train_batch_size)
        loader = torch.utils.data.DataLoader(
            self.train_dataset, batch_sampler=sampler, collate_fn=self.data_collator
        )
        return self.accelerator.prepare(loader)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        n_tokens = sum(int((shifted_labels(b["labels"]) != IGNORE).sum()) for b in batches)
        return batches, torch.tensor(max(n_tokens, 1), device=device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss_sum_B, n_B = token_losses(model, inputs)
        n = num_items_in_batch if num_items_in_batch is not None else n_B.sum().clamp(min=1)
        loss = loss_sum_B.sum() / n
        self._step_loss += loss.item()
        return (loss, None) if return_outputs else loss

    def step_log(self) -> list[dict]:
        """One record per optimizer step: step, loss (unrounded), grad_norm, learning_rate."""
        logged = {r["step"]: r for r in self.state.log_history if "loss" in r}
        first = self.state.global_step - len(self.step_losses) + 1
        return [
            {
                "step": first + i,
                "loss": loss,
                "grad_norm": logged.get(first + i, {}).get("grad_norm"),
                "learning_rate": logged.get(first + i, {}).get("learning_rate"),
            }
            for i, loss in enumerate(self.step_losses)
        ]


class _StepLoss(TrainerCallback):
    """Keeps the step's summed micro-batch losses (the step's token-mean loss) when the step ends."""

    def __init__(self, trainer: CompletionSFTTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.step_losses.append(self.trainer._step_loss)
        self.trainer._step_loss = 0.0


class _QuietProgress(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def _collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    return right_pad_batch([(r["input_ids"], r["labels"]) for r in rows], pad_token_id)
