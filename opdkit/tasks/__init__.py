"""Tasks: one kind of problem each, chosen once from the config (`for_dataset(cfg.dataset_path)`), each owning
its prompts, answer extraction, grading, forced-answer cue and held-out set; and the one accuracy function.

    task = for_dataset("tiny")              # tiny.TinyTask; math.Gsm8k, math.DapoMath, math.Math by file name
    acc = evaluate.accuracy(model, tok, task, messages, answers, max_new_tokens=40)   # raw (and forced)

- `base`: `Task`, what the jobs ask of a task;
- `tiny`: the tiny world's 3-digit addition with a scratchpad, its problem streams and exact-match grading;
- `tinytools`: the tiny tool world's four-term sums with a calculator to call, its streams and grading;
- `math`: GSM8K, DAPO-Math-17k and MATH-style problems graded by `answers` (math-verify);
- `evaluate`: greedy accuracy of a model (raw, and with its final answer forced; of greedy episodes with a
  tool environment), sharded over processes;
- `environment`: the environments a multi-turn episode plays against (tool calls parsed, answered, graded;
  the interface is `opdkit.rollout.episodes`), and `calculator`, the calculator tool's environment
  (`get_environment`, by the `environment` setting).
"""

from __future__ import annotations

from opdkit.config import ConfigError
from opdkit.rollout.episodes import Environment
from opdkit.tasks import calculator, math, tiny, tinytools
from opdkit.tasks.base import Task

TASKS: dict[str, type[Task]] = {
    "tiny": tiny.TinyTask,
    "tiny-tools": tinytools.TinyToolsTask,
    "gsm8k": math.Gsm8k,
    "dapo-math": math.DapoMath,
    "math": math.Math,
}


def get_task(name: str) -> Task:
    """The task called `name`: one of `TASKS`."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid: {sorted(TASKS)}.")
    return TASKS[name]()


def for_dataset(dataset_path: str) -> Task:
    """The task a config's prompts belong to: the tiny worlds' own ("tiny", "tiny-tools"); GSM8K or DAPO-Math
    when the path or hub name says so (gsm8k, dapo, in any part of it); any other math dataset otherwise."""
    if dataset_path == tiny.DATASET:
        return get_task("tiny")
    if dataset_path == tinytools.DATASET:
        return get_task("tiny-tools")
    name = dataset_path.lower()
    if "gsm8k" in name:
        return get_task("gsm8k")
    if "dapo" in name:
        return get_task("dapo-math")
    return get_task("math")


# The `environment` setting's choices (`opdkit.settings.ENVIRONMENTS`, torch-free) name these.
ENVIRONMENTS: dict[str, type[Environment]] = {"calculator": calculator.CalculatorEnvironment}


def get_environment(name: str, task: Task) -> Environment:
    """The multi-turn environment called `name` (one of `ENVIRONMENTS`), grading by `task`."""
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r}; valid: {sorted(ENVIRONMENTS)}.")
    return ENVIRONMENTS[name](task)
