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
from dataclasses import dataclass, field

import datasets

from opdkit.config import ConfigError
from opdkit.data import answers, prompts
from opdkit.run.folders import print0
from opdkit.tiny import task as tiny_task

Messages = list[dict]
OVERLAP_KINDS = ("train_in_eval", "eval_in_train", "train_in_excluded", "eval_repeats")


def removed(**counts: int) -> dict[str, int]:
    """Rows passed over to keep the sets apart, by kind (every kind present): `train_in_eval`, training rows
    whose prompt is an evaluation prompt; `eval_in_train`, evaluation candidates that are training prompts;
    `train_in_excluded`, training rows in the excluded set (a gradient's holdout); `eval_repeats`,
    evaluation candidates repeating one already taken."""
    return {k: counts.get(k, 0) for k in OVERLAP_KINDS}


@dataclass
class Split:
    """A job's training prompts and evaluation problems, apart by text, and what was passed over for that."""

    train: datasets.Dataset
    eval_messages: list[Messages]
    eval_answers: list[str]
    removed: dict[str, int] = field(default_factory=removed)


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

    def split(
        self,
        path: str,
        split: str,
        subset_size: int,
        eval_size: int,
        seed: int,
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> Split:
        """whitebox's training prompts (`subset_size` of `path`, -1: all) and `eval_size` evaluation problems,
        no evaluation prompt among the training prompts, no training prompt in `exclude` (`prompt_key`s,
        e.g. a gradient's holdout)."""
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

    def split(
        self,
        path: str,
        split: str,
        subset_size: int,
        eval_size: int,
        seed: int,
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> Split:
        """Training prompts from the tiny world's own stream, evaluation from its held-out pool, which no
        training stream holds (`tiny.task.training_problems`)."""
        ds = prompts.load_prompts(prompts.TINY, subset_size=subset_size, seed=seed)
        train = prompts.apart_from(ds["messages"], set(exclude))
        ds = ds.select(train.kept)
        messages, answers = self.heldout(eval_size) if eval_size else ([], [])
        held = prompts.apart_from(messages, prompts.prompt_keys(ds["messages"]))
        return Split(
            ds,
            [messages[i] for i in held.kept],
            [answers[i] for i in held.kept],
            removed(train_in_excluded=train.overlap, eval_in_train=held.overlap),
        )

    def holdout_prompts(
        self, path: str, split: str, fraction: float, subset_size: int, seed: int
    ) -> datasets.Dataset:
        """The holdout's own share of problems (`tiny.task.holdout_problems`), apart from every training
        stream and the evaluation pool by construction."""
        n = prompts.TINY_DEFAULT_SIZE if subset_size == -1 else subset_size
        return prompts.tiny_dataset(tiny_task.holdout_problems(n, seed + TINY_HOLDOUT_SEED_OFFSET))

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

    def split(
        self,
        path: str,
        split: str,
        subset_size: int,
        eval_size: int,
        seed: int,
        exclude: frozenset[str] | set[str] = frozenset(),
    ) -> Split:
        """In the seed-shuffled dataset: `subset_size` > 0 trains on the head (rows in `exclude` passed over)
        and evaluates on the next distinct prompts that are not training prompts; -1 evaluates on the last
        `eval_size` distinct prompts and trains on every row whose prompt is neither one of them nor in
        `exclude`. Apart by text (`prompts.prompt_key`), not by row, since a file may repeat a prompt (raw
        DAPO-Math-17k holds each about 100 times)."""
        exclude = set(exclude)
        if subset_size == -1:
            ds = prompts.load_prompts(path, split, -1, seed)
            msgs = list(ds["messages"])
            back = prompts.apart_from(msgs[::-1], set(), eval_size, distinct=True) if eval_size else None
            held = sorted(len(msgs) - 1 - i for i in back.kept) if back else []
            rest = sorted(set(range(len(msgs))) - set(held))
            in_eval = prompts.apart_from(
                [msgs[i] for i in rest], prompts.prompt_keys([msgs[i] for i in held])
            )
            rest = [rest[j] for j in in_eval.kept]
            excluded = prompts.apart_from([msgs[i] for i in rest], exclude)
            train = [rest[j] for j in excluded.kept]
            counts = removed(
                train_in_eval=in_eval.overlap,
                train_in_excluded=excluded.overlap,
                eval_repeats=back.repeats if back else 0,
            )
        else:
            want = subset_size + eval_size
            ds = prompts.load_prompts(path, split, want, seed)
            train, held, counts = self._head_split(list(ds["messages"]), subset_size, eval_size, exclude)
            if (len(train) < subset_size or len(held) < eval_size) and len(ds) == want:
                ds = prompts.load_prompts(path, split, -1, seed)  # passed-over rows: read further
                train, held, counts = self._head_split(list(ds["messages"]), subset_size, eval_size, exclude)
        if not train or (eval_size > 0 and not held):
            raise ConfigError(
                f"{path!r} holds {len(ds)} prompts: too few for subset_size={subset_size} training prompts "
                f"and eval_size={eval_size} held-out ones apart from them by text (prompts passed over: "
                f"{counts}); lower subset_size or eval_size."
            )
        rows = ds.select(held)
        return Split(ds.select(train), list(rows["messages"]), list(rows["answer"]), counts)

    @staticmethod
    def _head_split(
        msgs: list[Messages], subset_size: int, eval_size: int, exclude: set[str]
    ) -> tuple[list[int], list[int], dict[str, int]]:
        train = prompts.apart_from(msgs, exclude, subset_size)
        start = train.kept[-1] + 1 if train.kept else len(msgs)
        taken = prompts.prompt_keys([msgs[i] for i in train.kept])
        held = prompts.apart_from(msgs[start:], taken, eval_size, distinct=True)
        counts = removed(
            train_in_excluded=train.overlap, eval_in_train=held.overlap, eval_repeats=held.repeats
        )
        return train.kept, [start + i for i in held.kept], counts

    def holdout_prompts(
        self, path: str, split: str, fraction: float, subset_size: int, seed: int
    ) -> datasets.Dataset:
        """The tail `fraction` of the seed-shuffled dataset (the other jobs train on its head) without the
        prompts the head holds too, first `subset_size` of it."""
        ds = prompts.load_prompts(path, split, -1, seed)
        start = len(ds) - round(len(ds) * fraction)
        msgs = list(ds["messages"])
        tail = prompts.apart_from(msgs[start:], prompts.prompt_keys(msgs[:start]), subset_size)
        if tail.overlap:
            print0(f"holdout: {tail.overlap} rows left out, their prompts are in the training part too")
        return ds.select([start + i for i in tail.kept])


TASKS: dict[str, type[Task]] = {"tiny": TinyTask, "math": MathTask}


def get_task(name: str) -> Task:
    """The task called `name`: "tiny" or "math"."""
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; valid: {sorted(TASKS)}.")
    return TASKS[name]()


def for_dataset(dataset_path: str) -> Task:
    """The task a config's prompts belong to: the tiny world's own, else math with reference answers."""
    return get_task("tiny" if dataset_path == prompts.TINY else "math")
