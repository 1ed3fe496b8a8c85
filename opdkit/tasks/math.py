"""Math tasks: problems with a reference answer from a dataset, graded as a person would (`answers`: the last
`\\boxed{}`, `Answer:` line or `#### 18`, a sentence's answer only without one, judged equal by math-verify),
the final answer forced with the ADS reference's cue.

    task = for_dataset("data/gsm8k-main-test.parquet")      # Gsm8k; DapoMath for DAPO-Math-17k; Math
    otherwise task.check(r"... so she pays \\boxed{\\$18}.", "18")    # True

- `Math` (MATH-style): the reference is the `answer` column, else `reward_model.ground_truth`, `solution` or
  the assistant turn, its final answer read out (after GSM8K's `####`, else the last `\\boxed{}`, else all of
  it);
- `Gsm8k`: the `answer` column's worked solution, its final answer after `####`;
- `DapoMath`: DAPO-Math-17k's verl rows, the reference in `reward_model.ground_truth` (its prompts already ask
  for an `Answer:` line, which `answers` reads).
None has a held-out set of its own: jobs cut evaluation and gradient-holdout prompts from datasets.
"""

from __future__ import annotations

from opdkit.data import prompts
from opdkit.tasks import answers
from opdkit.tasks.base import Task


def final_answer(text: str) -> str:
    r"""The final answer in a worked solution: after GSM8K's ``####``, else a ``\boxed{}``, else all."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = answers.extract_boxed(text)
    return boxed if boxed is not None else text.strip()


class Math(Task):
    """MATH-style problems: any row layout `prompts.reference_sources` knows, boxed worked solutions."""

    name = "math"
    answer_cue = "\n\n**Final Answer**\n\\[\\boxed{"  # the ADS reference's answer-forcing string
    forced_answer_tokens = 32  # as the reference

    def reference_answer(self, row: dict, assistant: str | None) -> str:
        sources = prompts.reference_sources(row, assistant)
        return final_answer(sources[0]) if sources else ""

    def check(self, completion: str, answer: str) -> bool:
        """math-verify equivalence of the final answer (units, `\\$`, `%`, `1,600`, `1 000`, `1 1/2` = 1.5,
        `\\frac{1}{2}` = 0.5 allowed)."""
        return answers.check(completion, answer)

    def extract_answer(self, completion: str) -> str | None:
        span = answers.final_span(completion)
        return None if span is None else span[1].strip()

    def answer_start(self, completion: str) -> int | None:
        span = answers.final_span(completion)
        return None if span is None else span[0]


class Gsm8k(Math):
    """GSM8K (openai/gsm8k, GSM8K-Platinum): `question`, and `answer` a worked solution ending `#### 18`."""

    name = "gsm8k"

    def reference_answer(self, row: dict, assistant: str | None) -> str:
        solution = row.get("answer")
        if solution is not None and "####" in str(solution):
            return str(solution).rsplit("####", 1)[1].strip()
        return super().reference_answer(row, assistant)


class DapoMath(Math):
    """DAPO-Math-17k (verl schema): `prompt` messages asking for an `Answer:` line, the reference in
    `reward_model.ground_truth`."""

    name = "dapo-math"

    def reference_answer(self, row: dict, assistant: str | None) -> str:
        reward = row.get("reward_model")
        truth = reward.get("ground_truth") if isinstance(reward, dict) else None
        if truth is not None and str(truth).strip():
            return final_answer(str(truth))
        return super().reference_answer(row, assistant)
