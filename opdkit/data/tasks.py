"""Tasks: one kind of problem each, chosen once from the config. A task knows its prompts and held-out
problems, checks a completion against a reference answer, and finds where the answer begins.

    task = get_task("tiny")                        # or "math"; from a config: for_dataset(cfg.dataset_path)
    task.check("8+7=15,5+6+1=12,3+4+1=8;825", "825")                                   # True
    messages, answers = task.heldout(500)          # the tiny task's held-out problems
    task.answer_start(completion)                  # where the final answer begins (answer-token losses)

- `tiny`: the tiny world's 3-digit addition (`opdkit.tiny.task`): its own problem streams, exact match
  of the text after the last ';'; a forced answer follows a ';' after the working.
- `math`: problems with a reference answer from a dataset (GSM8K, DAPO-Math-17k): the final answer (the
  last `\\boxed{}` or `Answer:` line, whichever is later) judged equal by math-verify (`opdkit.data.answers`);
  a forced answer follows the ADS reference's cue, "**Final Answer**" and an open `\\[\\boxed{`.
"""

from __future__ import annotations

from collections.abc import Sequence

import datasets

from opdkit.config import ConfigError
from opdkit.data import answers, prompts
from opdkit.tiny import task as tiny_task

Messages = list[dict]

# The tiny holdout of savegrad is its own problem stream, apart from the training prompts whitebox
# draws with the same run seed (and from the evaluation seed): overlap is only by chance.
TINY_HOLDOUT_SEED_OFFSET = 7_919


class Task:
    """What the jobs ask of a kind of problem; subclasses answer for theirs."""

    name: str = ""
    max_new_tokens: int | None = None  # a completion budget that always suffices, where the task has one
    answer_cue: str = ""  # appended after a completion to force its final answer (`forced_prefix`)
    forced_answer_tokens: int = 0  # greedy tokens a forced answer may take after the cue

    def forced_prefix(self, completion: str) -> str:
        """The text a forced final answer continues (`opdkit.rollout.evaluate.forced_completions`): the
        completion, ended or cut, then the answer cue."""
        return completion + self.answer_cue

    def check(self, completion: str, answer: str) -> bool:
        """Is `completion`'s final answer the reference `answer`?"""
        raise NotImplementedError

    def extract_answer(self, completion: str) -> str | None:
        raise NotImplementedError

    def answer_start(self, completion: str) -> int | None:
        """Character offset where the completion's final answer begins; None without one."""
        raise NotImplementedError

    def heldout(self, n: int) -> tuple[list[Messages], list[str]]:
        """`n` built-in evaluation problems (prompt conversations, reference answers)."""
        raise ConfigError(
            f"the {self.name} task has no built-in held-out problems; give an evaluation dataset."
        )

    def train_prompts(
        self, path: str, split: str, subset_size: int, eval_size: int, seed: int
    ) -> datasets.Dataset:
        """whitebox's training prompts: `subset_size` of `path` (-1: all), never one of `eval_rows`'."""
        raise NotImplementedError

    def eval_rows(self, path: str, split: str, subset_size: int, eval_size: int, seed: int):
        """Held-out problems for a run trained on `train_prompts(...)` of the same arguments:
        (messages, answers)."""
        raise NotImplementedError

    def holdout_prompts(
        self, path: str, split: str, fraction: float, subset_size: int, seed: int
    ) -> datasets.Dataset:
        """savegrad's holdout: prompts apart from what the other jobs train on."""
        raise NotImplementedError

    def error_kinds(self, records: Sequence[dict]) -> dict[str, float] | None:
        """Kinds of wrong answers among `records` ({completion, correct}); None where the task cannot tell."""
        return None


class TinyTask(Task):
    name = "tiny"
    max_new_tokens = tiny_task.MAX_COMPLETION_TOKENS
    answer_cue = tiny_task.ANSWER_SEP
    forced_answer_tokens = 5  # up to 4 digits (999 + 999 = 1998), then EOS

    def forced_prefix(self, completion: str) -> str:
        """The working before the completion's answer (all of it when it has none), then `;`: a finished
        completion's answer is written again (greedily: the same one), a cut one gets one."""
        at = completion.rfind(tiny_task.ANSWER_SEP)
        return (completion if at < 0 else completion[:at]) + self.answer_cue

    def check(self, completion: str, answer: str) -> bool:
        return tiny_task.extract_answer(completion) == answer

    def extract_answer(self, completion: str) -> str | None:
        return tiny_task.extract_answer(completion)

    def answer_start(self, completion: str) -> int | None:
        at = completion.rfind(tiny_task.ANSWER_SEP)
        return None if at < 0 else at + 1

    def heldout(self, n: int, seed: int | None = None) -> tuple[list[Messages], list[str]]:
        """`n` held-out problems; `seed` draws another stream (the build's own evaluation uses one)."""
        probs = tiny_task.heldout_problems(n) if seed is None else tiny_task.problems(n, seed)
        return [[{"role": "user", "content": p.prompt}] for p in probs], [p.answer for p in probs]

    def train_prompts(
        self, path: str, split: str, subset_size: int, eval_size: int, seed: int
    ) -> datasets.Dataset:
        return prompts.load_prompts(
            prompts.TINY, subset_size=subset_size, seed=seed
        )  # its own stream, apart from heldout

    def eval_rows(self, path: str, split: str, subset_size: int, eval_size: int, seed: int):
        return self.heldout(eval_size)

    def holdout_prompts(
        self, path: str, split: str, fraction: float, subset_size: int, seed: int
    ) -> datasets.Dataset:
        return prompts.load_prompts(
            prompts.TINY, subset_size=subset_size, seed=seed + TINY_HOLDOUT_SEED_OFFSET
        )

    def error_kinds(self, records: Sequence[dict]) -> dict[str, float] | None:
        """The share of checked traces whose wrong answer follows from their own (mistaken) working, `slip`,
        and whose wrong answer contradicts it (or whose working is malformed), `contradiction`."""
        checked = [r for r in records if r["correct"] is not None]
        if not checked:
            return None
        wrong = [r for r in checked if not r["correct"]]
        slips = sum(
            tiny_task.extract_answer(r["completion"]) == tiny_task.implied_answer(r["completion"])
            for r in wrong
        )
        return {"slip": slips / len(checked), "contradiction": (len(wrong) - slips) / len(checked)}


class MathTask(Task):
    name = "math"
    answer_cue = "\n\n**Final Answer**\n\\[\\boxed{"  # the ADS reference's answer-forcing string
    forced_answer_tokens = 32  # as the reference

    def check(self, completion: str, answer: str) -> bool:
        """math-verify equivalence of the final answer (units, `\\$`, `%`, `1,600`, `\\frac{1}{2}` = 0.5
        allowed)."""
        return answers.check(completion, answer)

    def extract_answer(self, completion: str) -> str | None:
        span = answers.final_span(completion)
        return None if span is None else span[1].strip()

    def answer_start(self, completion: str) -> int | None:
        span = answers.final_span(completion)
        return None if span is None else span[0]

    def train_prompts(
        self, path: str, split: str, subset_size: int, eval_size: int, seed: int
    ) -> datasets.Dataset:
        """The head of the seed-shuffled dataset: `subset_size` rows, or (-1) all but the last `eval_size`."""
        ds, (train, _) = self._split(path, split, subset_size, eval_size, seed)
        return ds.select(train)

    def eval_rows(self, path: str, split: str, subset_size: int, eval_size: int, seed: int):
        """The `eval_size` rows after the training rows in the same seed-shuffled order (fewer if the file
        ends)."""
        ds, (_, held) = self._split(path, split, subset_size, eval_size, seed)
        rows = ds.select(held)
        return list(rows["messages"]), list(rows["answer"])

    @staticmethod
    def _split(
        path: str, split: str, subset_size: int, eval_size: int, seed: int
    ) -> tuple[datasets.Dataset, tuple]:
        """The shuffled rows and (training indices, evaluation indices): two disjoint ranges, by
        construction."""
        ds = prompts.load_prompts(path, split, subset_size + eval_size if subset_size > 0 else -1, seed)
        n_train = min(subset_size, len(ds)) if subset_size > 0 else len(ds) - eval_size
        if n_train < 1 or (eval_size > 0 and n_train >= len(ds)):
            raise ConfigError(
                f"{path!r} holds {len(ds)} prompts: too few for subset_size={subset_size} training prompts "
                f"and eval_size={eval_size} held-out ones apart from them; lower subset_size or eval_size."
            )
        return ds, (range(n_train), range(n_train, min(len(ds), n_train + eval_size)))

    def holdout_prompts(
        self, path: str, split: str, fraction: float, subset_size: int, seed: int
    ) -> datasets.Dataset:
        """The tail `fraction` of the seed-shuffled dataset (the other jobs train on its head), first
        `subset_size` of it."""
        ds = prompts.load_prompts(path, split, -1, seed)
        start = len(ds) - round(len(ds) * fraction)
        stop = len(ds) if subset_size == -1 else min(len(ds), start + subset_size)
        return ds.select(range(start, stop)) if stop > start else ds.select([])


TASKS: dict[str, type[Task]] = {"tiny": TinyTask, "math": MathTask}


def get_task(name: str) -> Task:
    """The task called `name`: "tiny" or "math"."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid: {sorted(TASKS)}.")
    return TASKS[name]()


def for_dataset(dataset_path: str) -> Task:
    """The task a config's prompts belong to: the tiny world's own, else math with reference answers."""
    return get_task("tiny" if dataset_path == prompts.TINY else "math")
