"""How the white-box run measures accuracy: greedy, raw and forced, split across its processes, every model
decoded under the run's one precision (`tasks.evaluate.configured_accuracy`)."""

from __future__ import annotations

from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.jobs.whitebox.inputs import Prepared
from opdkit.tasks.evaluate import Accuracy, configured_accuracy


def accuracy_precision(cfg: WhiteboxConfig) -> str:
    """How the run's accuracies decode. With the kit's loop every model decodes at the precision the
    student samples its rollouts at; with vLLM the student's (before, while and after training) decode in
    the engine at its weights' dtype, the teacher's on the kit's loop."""
    loop = "bf16 autocast" if cfg.bf16 else "fp32"
    return loop if cfg.rollout_engine == "hf" else f"student vLLM {engine_dtype(cfg.bf16)}, teacher {loop}"


def engine_dtype(bf16: bool) -> str:
    return "bfloat16" if bf16 else "float32"


def sharded_accuracies(
    model,
    prep: Prepared,
    world: int,
    rank: int,
    limit: int | None = None,
    engine=None,
    forced: bool | None = None,
    tokenizer=None,
) -> Accuracy:
    """Greedy accuracy (raw, forced; with an `environment`, of greedy episodes and their `tool_call_share`) on
    the first `limit` evaluation problems, split across processes, every model decoded under the run's one
    autocast (`accuracy_precision`; `tasks.evaluate.configured_accuracy`); `tokenizer`: the model's, when not
    the student's (a teacher with another tokenizer)."""
    messages, answers = prep.eval_messages[:limit], prep.eval_answers[:limit]
    return configured_accuracy(
        prep.cfg,
        model,
        tokenizer or prep.tokenizer,
        prep.task,
        messages,
        answers,
        forced=forced,
        engine=engine,
        world=world,
        rank=rank,
        progress=rank == 0,
    )


def tool_measures(cfg: WhiteboxConfig, student_before, student_after, teacher) -> dict:
    """With an `environment`: the share of greedy episodes that call the tools correctly
    (`Accuracy.tool_call_share`), before and after training and the teacher's; {} without one (or unmeasured,
    None)."""
    if not cfg.environment:
        return {}
    share = lambda a: None if a is None else a.tool_call_share  # noqa: E731
    return {
        "student_tool_call_share_before": share(student_before),
        "student_tool_call_share_after": share(student_after),
        "teacher_tool_call_share": share(teacher),
    }
