"""Completion-only supervised fine-tuning on transformers' `Trainer`: `CompletionSFTTrainer` (checkpoints,
LoRA through peft, `report_to`), the one SFT loop of the kit (antidistill's students, the tiny world's
recipe).

    trainer = CompletionSFTTrainer(model=m, args=TrainingArguments(...), train_dataset=rows, order=order,
                                   pad_token_id=tok.pad_token_id); trainer.train(); trainer.step_log()

Each optimizer step's summed completion-token losses are divided by all of the step's completion tokens, so
the loss is the token mean of the step whatever the micro-batch size; the rows come in the order given
(`order`: per step, row indices), and each checkpoint records the hash of the rows it trained on
(`TRAINED_ON_FILE`), so a resume on other rows is refused (`trained_on_problem`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from opdkit.data.labels import IGNORE, right_pad_batch, shifted_labels, token_losses
from opdkit.run.files import atomic_write_text

TRAINED_ON_FILE = "trained_on.sha256"  # in each checkpoint of a CompletionSFTTrainer: its rows' hash


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
    """Completion-only SFT on transformers' `Trainer`: each optimizer step's summed completion-token losses
    divided by all of the step's completion tokens (`num_items_in_batch`), so the loss is the token mean of
    the step whatever the micro-batch size; rows in the order of `order` (per step, row indices of
    `train_dataset`, a sequence of {input_ids, labels}) in micro-batches of
    `args.per_device_train_batch_size`, with `args.gradient_accumulation_steps` = micro-batches per step.

    The Trainer's AdamW leaves biases and norm weights undecayed (as TRL's SFTTrainer, the ADS reference's),
    and `bf16` is the Trainer's mixed precision. `step_losses` holds every step's loss unrounded; checkpoints,
    `report_to`, LoRA (a peft model) are the Trainer's own."""

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
        self.model_accepts_loss_kwargs = True  # compute_loss divides by num_items_in_batch itself
        self.add_callback(_StepLoss(self))
        # the bar without a printed dict per step, nor, in a notebook kernel, transformers' growing step table
        # (NotebookProgressCallback, which is not a ProgressCallback); without a bar (disable_tqdm), no dicts
        self.pop_callback(PrinterCallback)
        table = _notebook_progress()
        if self.pop_callback(ProgressCallback) or (table is not None and self.pop_callback(table)):
            self.add_callback(_QuietProgress())

    @functools.cached_property
    def rows_sha256(self) -> str:
        """The hash of the rows it trains on, computed at the first checkpoint (a long stream of rows made on
        the fly, as the tiny world's recipe trains on, is never read whole otherwise)."""
        return rows_sha256(self.train_dataset)

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
    """Keeps the step's summed micro-batch losses (the step's token-mean loss) when the step ends. Holds its
    trainer weakly (no reference cycle keeping a finished trainer's model alive)."""

    def __init__(self, trainer: CompletionSFTTrainer):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None:
            trainer.step_losses.append(trainer._step_loss)
            trainer._step_loss = 0.0


def _notebook_progress() -> type | None:
    """transformers' notebook table callback; None without IPython (the vLLM venv), where none is added."""
    try:
        from transformers.utils.notebook import NotebookProgressCallback
    except ImportError:
        return None
    return NotebookProgressCallback


class _QuietProgress(ProgressCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        pass


def _collate(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    return right_pad_batch([(r["input_ids"], r["labels"]) for r in rows], pad_token_id)
