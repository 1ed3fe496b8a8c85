"""How the white-box run measures accuracy: greedy, raw and forced, split across its processes, every model
decoded under the run's one precision (`tasks.evaluate.configured_accuracy`); and what its summary and its
`eval_every` steps say of them.

    before = kept_before(earlier_summary) or sharded_accuracies(student, prep, world, rank)
    summary = {**accuracy_facts(cfg, before, after, teacher), ...}
"""

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


def kept_before(summary: dict) -> Accuracy | None:
    """The student's accuracy before training as a resumed run's summary kept it; None when it holds none."""
    before = summary.get("student_accuracy_before")
    if before is None:
        return None
    forced, share = (
        summary.get("student_accuracy_before_forced"),
        summary.get("student_tool_call_share_before"),
    )
    return Accuracy(before, forced, tool_call_share=share)


def accuracy_facts(
    cfg: WhiteboxConfig, before: Accuracy, after: Accuracy | None, teacher: Accuracy | None
) -> dict:
    """The summary's accuracies: the student's before and (once trained, `after`) after, the teacher's (None:
    not measured here), the forced ones with `forced_accuracy`, the tool-call shares with an `environment`
    (`tool_measures`), and how they decode (`accuracy_precision`)."""
    facts = {"student_accuracy_before": before.raw}
    if after is not None:
        facts["student_accuracy_after"] = after.raw
    facts["teacher_accuracy"] = None if teacher is None else teacher.raw
    if cfg.forced_accuracy:
        facts["student_accuracy_before_forced"] = before.forced
        facts["teacher_accuracy_forced"] = None if teacher is None else teacher.forced
        if after is not None:
            facts["student_accuracy_after_forced"] = after.forced
    tools = tool_measures(cfg, before, after, teacher)
    facts.update({k: v for k, v in tools.items() if after is not None or "after" not in k})
    return {**facts, "accuracy_precision": accuracy_precision(cfg)}


def step_measure(acc: Accuracy) -> float | dict | None:
    """What `eval_every` logs: the accuracy (`eval_accuracy`), with an environment also the share of episodes
    that call the tools correctly (`eval_tool_call_share`)."""
    if acc.tool_call_share is None:
        return acc.raw
    return {"eval_accuracy": acc.raw, "eval_tool_call_share": acc.tool_call_share}
