"""The SFT loop's batches (opdkit.sft.trainer): `batch_order` covers every trace each epoch, `StepBatches`
cuts each step into micro-batches in order, and `CompletionSFTTrainer` refuses steps that do not match its
gradient accumulation. Its losses, checkpoints and resume are tested through the students
(tests/test_sft_student.py)."""

from __future__ import annotations

import pytest
from helpers import tiny_model
from transformers import TrainingArguments

from opdkit.sft.trainer import CompletionSFTTrainer, StepBatches, batch_order


def test_batch_order_covers_every_trace_each_epoch():
    order = batch_order(10, 4, 5, seed=0)
    flat = [i for step in order for i in step]
    assert len(order) == 5 and all(len(s) == 4 for s in order)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert batch_order(10, 4, 5, seed=0) == order and batch_order(10, 4, 5, seed=1) != order


def test_step_batches_cut_each_step_in_order():
    order = [[4, 1, 7, 0, 2], [3, 9, 8, 6, 5]]
    sampler = StepBatches(order, 2)
    assert list(sampler) == [[4, 1], [7, 0], [2], [3, 9], [8, 6], [5]] and len(sampler) == 6


def test_trainer_refuses_steps_that_do_not_match_its_accumulation(tmp_path, tok):
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 6
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to=[],
    )
    model = tiny_model("tiny:student")
    kwargs = dict(model=model, args=args, train_dataset=rows, pad_token_id=tok.pad_token_id)
    CompletionSFTTrainer(order=[[0, 1, 2, 3], [4, 5, 0]], **kwargs)  # 2 micro-batches a step: fits
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        CompletionSFTTrainer(order=[[0, 1, 2, 3, 4, 5]], **kwargs)  # 3 micro-batches in one step


def test_a_trained_sft_trainer_is_freed_without_a_garbage_collection(tmp_path, tok):
    """issue 28: no reference cycle (its step-loss callback holds it weakly) keeps a finished trainer's model
    and optimizer alive until a garbage collection; 04 trains one per point and seed."""
    import gc
    import weakref

    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 4
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = CompletionSFTTrainer(
        model=tiny_model("tiny:student"),
        args=args,
        train_dataset=rows,
        pad_token_id=tok.pad_token_id,
        order=[[0, 1], [2, 3]],
    )
    trainer.train()
    assert len(trainer.step_losses) == 2  # the callback still does its work
    refs = [weakref.ref(x) for x in (trainer, trainer.model, trainer.optimizer)]
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert [r() is None for r in refs] == [True] * 3
    finally:
        gc.enable()


def test_in_a_notebook_kernel_the_step_table_gives_way_to_a_quiet_bar(tmp_path, tok, monkeypatch):
    """In a kernel transformers adds NotebookProgressCallback (a growing "Step | Training Loss" table), which
    is no ProgressCallback: the trainer takes it out too, for its bar without a printed dict per step."""
    import transformers.trainer
    from transformers.utils.notebook import NotebookProgressCallback

    monkeypatch.setattr(transformers.trainer, "DEFAULT_PROGRESS_CALLBACK", NotebookProgressCallback)
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}] * 4
    kwargs = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, use_cpu=True, report_to=[])

    def callbacks(disable_tqdm: bool) -> list[str]:
        trainer = CompletionSFTTrainer(
            model=tiny_model("tiny:student"),
            args=TrainingArguments(**kwargs, disable_tqdm=disable_tqdm),  # its default follows the log level
            train_dataset=rows,
            pad_token_id=tok.pad_token_id,
            order=[[0, 1]],
        )
        return [type(c).__name__ for c in trainer.callback_handler.callbacks]

    kinds = callbacks(disable_tqdm=False)
    assert "NotebookProgressCallback" not in kinds and "_QuietProgress" in kinds
    quiet = callbacks(disable_tqdm=True)  # no bar: transformers' PrinterCallback would print a dict per step
    assert "PrinterCallback" not in quiet and "_QuietProgress" not in quiet
