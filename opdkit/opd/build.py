"""The one place a `DistillTrainer` is assembled from a job's config: 02's run (and so 03's arms, which are 02
runs) and 04's on-policy attackers.

    args = training_arguments(cfg, "runs/x/checkpoints", run_name="whitebox/x")    # opd.arguments
    trainer = distill_trainer(cfg, args, student, teacher, tokenizer, dataset, teacher_tokenizer=t_tok)

The config gives what the prompts are batched with (`max_prompt_length`, `enable_thinking`) and the
rollouts' environment (`environment`: multi-turn episodes against a tool environment of `opdkit.tasks`); the
student, the teacher (any kind the trainer takes), the prompts and the arguments are the job's.
"""

from __future__ import annotations

from typing import Any

from opdkit import tasks
from opdkit.data.prompts import PromptCollator
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.run.folders import RunDir


def distill_trainer(
    cfg: Any,
    args: OPDArguments,
    student,
    teacher,
    tokenizer,
    dataset,
    *,
    teacher_tokenizer=None,
    run: RunDir | None = None,
    callbacks: list | None = None,
) -> DistillTrainer:
    """The trainer distilling `teacher` into `student` on `dataset`'s prompts (rows with `messages`), batched
    at the config's `max_prompt_length` with its `enable_thinking`; `teacher_tokenizer` tells the trainer
    whether the teacher's tokens differ from the student's (None: the same, or a teacher set that routes by
    itself); `run` receives its logs, `callbacks` are transformers `TrainerCallback`s. With the config's
    `environment` set, the trainer plays multi-turn episodes against it (graded by the config's task), and the
    prompts are templated with its tools."""
    env = None
    if getattr(cfg, "environment", ""):
        env = tasks.get_environment(cfg.environment, tasks.for_dataset(cfg.dataset_path))
    tools = None if env is None else env.tools
    return DistillTrainer(
        model=student,
        args=args,
        train_dataset=dataset,
        data_collator=PromptCollator(tokenizer, cfg.max_prompt_length, cfg.enable_thinking, tools),
        processing_class=tokenizer,
        teacher_model=teacher,
        teacher_tokenizer=teacher_tokenizer,
        run=run,
        callbacks=callbacks,
        env=env,
    )
