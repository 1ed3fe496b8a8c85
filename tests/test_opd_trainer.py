"""`DistillTrainer` frees itself: no reference cycle keeps a finished trainer (and its models' memory) alive
until a garbage collection happens to run (issue 28)."""

from __future__ import annotations

import gc
import weakref

from datasets import Dataset
from helpers import tiny_model

from opdkit.data.prompts import PromptCollator
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.tasks import tiny as task


def test_a_trained_distill_trainer_is_freed_without_a_garbage_collection(tmp_path, capsys):
    tok = load_tokenizer("tiny:student")
    problems = task.problems(4, 1)
    rows = [{"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in problems]
    args = OPDArguments(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        max_steps=1,
        per_device_train_batch_size=2,
        rollout_max_new_tokens=4,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = DistillTrainer(
        model=tiny_model("tiny:student"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        data_collator=PromptCollator(tok, 64),
        processing_class=tok,
        teacher_model=tiny_model("tiny:teacher"),
    )
    trainer.train()
    # What this process holds, said when training begins (one process: everything; see
    # tests/test_run_sharding.py for two sharded ones).
    n_student = sum(p.numel() for p in trainer.model.parameters())
    assert f"rank 0 of 1 holds student {n_student:,} of {n_student:,} params" in capsys.readouterr().out
    refs = [weakref.ref(x) for x in (trainer, trainer.model, trainer.teacher, trainer.optimizer)]
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert [r() is None for r in refs] == [True] * 4  # trainer, student, teacher, AdamW state
    finally:
        gc.enable()
