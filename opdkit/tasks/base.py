"""`Task`: what the jobs ask of one kind of problem. Each task owns its prompts (where they come from and how
a row's reference answer is read), its answer extraction and grading, its forced-answer cue, and its held-out
set where it has one of its own.

    task = get_task("tiny")                        # or from a config: for_dataset(cfg.dataset_path)
    ds = task.load_prompts(path, split, 1000, seed)                # columns messages, answer
    task.check("8+7=15,5+6+1=12,3+4+1=8;825", "825")              # True
    task.answer_start(completion)                  # where the final answer begins (answer-token losses)

Jobs keep their own splits (which prompts train, which evaluate, which make a gradient's holdout); a task only
says what it has: `heldout` (built-in evaluation problems, or None) and `reserved_holdout` (a stream of its
own for gradient holdouts, or None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from opdkit.data import prompts

if TYPE_CHECKING:
    import datasets

Messages = list[dict]


class Task:
    """One kind of problem; subclasses answer for theirs."""

    name: str = ""
    max_new_tokens: int | None = None  # a completion budget that always suffices, where the task has one
    answer_cue: str = ""  # appended after a completion to force its final answer (`forced_prefix`)
    forced_answer_tokens: int = 0  # greedy tokens a forced answer may take after the cue
    has_heldout: bool = False  # evaluation problems of its own (`heldout`)

    def load_prompts(
        self, path: str, split: str = "train", subset_size: int = -1, seed: int = 42
    ) -> datasets.Dataset:
        """The first `subset_size` (-1: all) prompts of `path` in its `seed` shuffle: columns `messages` and
        `answer`, the reference as this task reads it (`reference_answer`)."""
        return prompts.load_prompts(path, split, subset_size, seed, self.reference_answer)

    def load_apart(
        self, path: str, split: str, size: int, seed: int, taken: set[str]
    ) -> tuple[datasets.Dataset, prompts.Apart]:
        """`size` distinct prompts of `path` none of which is in `taken` (`prompts.load_apart`)."""
        return prompts.load_apart(path, split, size, seed, taken, reference=self.reference_answer)

    def reference_answer(self, row: dict, assistant: str | None) -> str:
        """A data row's reference answer."""
        return prompts.plain_reference(row, assistant)

    def heldout(self, n: int) -> tuple[list[Messages], list[str]] | None:
        """`n` built-in evaluation problems (prompt conversations, reference answers); None: the task has
        none, its evaluation problems come from a dataset."""
        return None

    def reserved_holdout(self, n: int, seed: int) -> datasets.Dataset | None:
        """`n` prompts of a stream kept for gradient holdouts, apart from every training stream and the
        held-out set by construction; None: the task has none, a holdout is cut from a dataset."""
        return None

    def forced_prefix(self, completion: str) -> str:
        """The text a forced final answer continues (`opdkit.tasks.evaluate`): the completion, ended or cut,
        then the answer cue."""
        return completion + self.answer_cue

    def check(self, completion: str, answer: str) -> bool:
        """Is `completion`'s final answer the reference `answer`?"""
        raise NotImplementedError

    def extract_answer(self, completion: str) -> str | None:
        raise NotImplementedError

    def answer_start(self, completion: str) -> int | None:
        """Character offset where the completion's final answer begins; None without one."""
        raise NotImplementedError

    def error_kinds(self, records: Sequence[dict]) -> dict[str, float] | None:
        """Kinds of wrong answers among trace `records` (`data.traces`: messages, correct); None where the
        task cannot tell."""
        return None
