"""Where a step's rollouts come from: a source the trainer asks for "the next step's rollouts" and whose
records it only reads.

    source = EngineRollouts(make_engine, settings, seed=42, rank=0, world=1, batch_size=64)
    records = source.next_step(student, prompt_batches, step)    # one `RolloutRecord` per micro-batch
    pred_BT = records[0].predicting_BT()                          # where the loss reads the student's states

A record is a micro-batch of token rows with a **per-token loss mask**: 1 on the tokens the student sampled,
0 on everything else (prompt, padding, and in a multi-turn episode the tool outputs the student did not
write). The divergence, the teacher's scoring positions, the step's counts and the per-token explorer read
that mask, never "everything after the prompt"; a single-turn rollout is the one-segment case (the completion
up to and including its first stop token).

Sources that plug in here: `EngineRollouts`, today's synchronous one (the engine's weight sync, then one
`engine.sample` call for every prompt of the step, then the rows regrouped by length into micro-batches);
`ahead.AheadRollouts`, which samples up to `rollout_ahead` steps ahead of training in a process of its own
(its records stale by up to that many policy steps, their `sampling_logprobs_BT` the sampling weights' own,
their `policy_version` which weights); a multi-turn episode source (several sampled segments per row, the
environment's turns masked out) would give the same records.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from opdkit.rollout import engines, microbatches, sampling
from opdkit.rollout.weights import Weights


@dataclass(frozen=True)
class Conversations:
    """A multi-turn record's rows as messages, for a teacher that renders them with its own chat template (a
    teacher of another tokenizer): each row's conversation (the prompt's messages, then every student turn as
    an assistant message, its text as the student sampled it, with the tool messages between), the `tools`
    and `enable_thinking` the student's template rendered it with. The student's turns are each row's last
    assistant messages, one per run of mask-1 tokens, in order."""

    messages: list[list[dict]]
    tools: list[dict] | None = None
    enable_thinking: bool = False


@dataclass(frozen=True)
class RolloutRecord:
    """A micro-batch of rollouts as the trainer reads it (B rows, T columns, left-padded contexts).

    `loss_mask_BT` is 1 on the tokens the student sampled (the ones the loss is over), 0 elsewhere;
    `sampling_logprobs_BT` the engine's log-probability of each sampled token at temperature 1 (0 elsewhere),
    None when the engine reports none; `truncated_B` rows that never sampled a stop token; `sampled_as` each
    row's place in the step's sampling order; `answers` and `teacher_ids` the prompts' columns (None where
    absent); `policy_version` the optimizer steps the weights that sampled it had taken (None: the current
    weights, sampled in the step; staleness = the trainer's step - policy_version); `conversations` each row's
    conversation as messages (a multi-turn source's records; None elsewhere)."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    truncated_B: torch.Tensor
    sampled_as: list[int]
    answers: list
    teacher_ids: list | None = None
    sampling_logprobs_BT: torch.Tensor | None = None
    policy_version: int | None = None
    conversations: Conversations | None = None

    def predicting_BT(self) -> torch.Tensor:
        """The positions whose state predicts a loss token: the loss mask shifted left by one (the state at t
        predicts token t+1), row after row in the order `hidden[pred_BT]` reads them."""
        pred_BT = torch.zeros_like(self.attention_mask_BT, dtype=torch.bool)
        pred_BT[:, :-1] = self.loss_mask_BT[:, 1:].bool()
        return pred_BT

    def position_ids_BT(self) -> torch.Tensor:
        """Each token's position, counted from the row's first attended token (left padding skipped)."""
        return sampling.position_ids_from_mask(self.attention_mask_BT)

    def context_BT(self) -> torch.Tensor:
        """The attended tokens before each row's first loss token (a single-turn row's prompt)."""
        first_B = torch.where(
            self.loss_mask_BT.bool().any(1),
            self.loss_mask_BT.bool().int().argmax(1),
            torch.full_like(self.truncated_B, self.loss_mask_BT.shape[1], dtype=torch.long),
        )
        cols_BT = torch.arange(self.loss_mask_BT.shape[1], device=first_B.device)[None, :]
        return self.attention_mask_BT.bool() & (cols_BT < first_B[:, None])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record's tensors by name (what save_rollouts keeps)."""
        out = {
            "input_ids": self.input_ids_BT,
            "attention_mask": self.attention_mask_BT,
            "loss_mask_BT": self.loss_mask_BT,
        }
        if self.sampling_logprobs_BT is not None:
            out["sampling_logprobs_BT"] = self.sampling_logprobs_BT
        return out


def record_of(
    r: sampling.Rollout,
    stop_ids: list[int],
    sampled_as: list[int] | None = None,
    answers: list | None = None,
    teacher_ids: list | None = None,
) -> RolloutRecord:
    """A single-turn `sampling.Rollout` (prompt columns, then completion columns) as a record: its completion
    mask placed on the full row is the loss mask, the engine's log-probabilities likewise."""
    B, P = r.input_ids_BT.shape[0], r.prompt_len
    loss_mask_BT = torch.zeros_like(r.input_ids_BT, dtype=r.completion_mask_BC.dtype)
    loss_mask_BT[:, P:] = r.completion_mask_BC
    logprobs_BT = None
    if r.logprobs_BC is not None:
        logprobs_BT = r.logprobs_BC.new_zeros(r.input_ids_BT.shape)
        logprobs_BT[:, P:] = r.logprobs_BC
    return RolloutRecord(
        input_ids_BT=r.input_ids_BT,
        attention_mask_BT=r.attention_mask_BT,
        loss_mask_BT=loss_mask_BT,
        truncated_B=r.truncated_B(stop_ids),
        sampled_as=list(range(B)) if sampled_as is None else sampled_as,
        answers=[None] * B if answers is None else answers,
        teacher_ids=teacher_ids,
        sampling_logprobs_BT=logprobs_BT,
    )


class RolloutSource(ABC):
    """What the trainer asks for a step's rollouts, and the optional calls it makes of every source (each a
    no-op by default): the step's prompts, the source's own metrics, its state at a checkpoint and on resume,
    the weights that sampled a record. `ahead`: how many steps ahead of training the source samples (0: each
    step's rollouts in the step, by the current weights).

    A `step` argument is the optimizer step's index, 0-based (the optimizer steps taken before it, the
    trainer's `global_step` when the step starts); what is logged and said to a person numbers it from 1
    (`step + 1`, metrics.jsonl's `step`)."""

    ahead: int = 0

    def prompts(self, epoch_iterator: Iterator, num_batches: int, step: int) -> list[dict]:
        """The step's prompt micro-batches: the next `num_batches` of the epoch's data iterator (fewer at its
        end), as `Trainer.get_batch_samples` pulls them."""
        return list(itertools.islice(epoch_iterator, num_batches))

    @abstractmethod
    def open(self) -> None:
        """Get ready before the step's clock starts (e.g. build an engine: a vLLM one takes tens of
        seconds)."""

    @abstractmethod
    def next_step(self, student: torch.nn.Module, batches: list[dict], step: int) -> list[RolloutRecord]:
        """The rollouts of optimizer step `step` for the step's prompt micro-batches (`batches`, as the
        prompt collator makes them), one record per micro-batch, with `student` the current policy."""

    def step_metrics(self, sum_over_processes: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """The source's own columns of a step's metrics.jsonl record (none by default);
        `sum_over_processes(t)` takes a float64 tensor, moves it to the trainer's device and sums it over
        processes (identity in one process)."""
        return {}

    def save(self, folder: Path) -> None:  # noqa: B027 - most sources keep nothing
        """Write what the source needs to resume into checkpoint `folder` (before the trainer's own files)."""

    def load(self, folder: Path) -> None:  # noqa: B027 - most sources keep nothing
        """Resume from checkpoint `folder` (what `save` wrote there, if anything)."""

    def weights_of(self, version: int) -> Weights | None:
        """The weights that sampled records of `policy_version` `version`, while the source keeps them (the
        trainer measures the sampler's log-probabilities against them); None: not kept."""
        return None

    def logprob_dtype(self) -> str:
        """The dtype the engine computes the log-probabilities it reports in (`sampling_logprobs_BT`), which
        sets the tolerance of the trainer's check of them."""
        return "float32"

    @abstractmethod
    def close(self) -> None:
        """Give back what the source holds when the run is over."""


class EngineRollouts(RolloutSource):
    """Synchronous rollouts through a rollout engine (`engines.make_engine`, built by `make_engine` at the
    first use): the student's weights synced once per optimizer step (so also before the first rollout after
    a resume), all of the step's prompts sampled in one engine call, then regrouped by completion length
    (`microbatches.length_order`) and cut back into micro-batches of the same sizes. Each row is sampled from
    its own stream, keyed by (seed, step, its place in the step's global batch) (`engines.rollout_seeds`,
    `microbatches.global_places`): 1, 2 or 8 processes draw the same completions for the same prompts, and a
    resumed run samples exactly what an unbroken run would have, whatever the RNG history before the
    checkpoint."""

    def __init__(
        self,
        make_engine: Callable[[], engines.HFEngine | engines.VLLMEngine],
        settings: engines.SamplingSettings,
        seed: int,
        rank: int,
        world: int,
        batch_size: int,
    ):
        self._make_engine, self.settings = make_engine, settings
        self.seed, self.rank, self.world, self.batch_size = seed, rank, world, batch_size
        self._engine: engines.HFEngine | engines.VLLMEngine | None = None
        # The last step's own numbers, summed into `step_metrics` (a multi-turn source's episodes, calls,
        # turns ...; none here); a producer sampling ahead sends them back with the step's records.
        self.counts: dict[str, float] = {}

    def engine(self) -> engines.HFEngine | engines.VLLMEngine:
        """The rollout engine, built at the first use."""
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    def open(self) -> None:
        self.engine()

    def logprob_dtype(self) -> str:
        return self.engine().dtype

    def next_step(self, student: torch.nn.Module, batches: list[dict], step: int) -> list[RolloutRecord]:
        if not batches:
            return []
        self.engine().sync(student)
        return self.sampled(student, batches, step)

    def sampled(self, student: torch.nn.Module | None, batches: list[dict], step: int) -> list[RolloutRecord]:
        """The step's records from the engine as it is, its weights already in (`next_step` syncs them
        first; a producer sampling ahead loads those it was sent). `student`: what the engine samples with
        (the kit's loop; None for vLLM, which holds its own weights)."""
        engine = self.engine()
        s = self.settings
        ids_BP, mask_BP = microbatches.concat_prompts(batches, s.pad_token_id)
        sizes = [b["prompts"].shape[0] for b in batches]
        places = microbatches.global_places(sizes, self.rank, self.world, self.batch_size)
        whole = engine.sample(student, ids_BP, mask_BP, s, engines.rollout_seeds(self.seed, step, places))
        answers = [a for b, n in zip(batches, sizes) for a in (b.get("answers") or [None] * n)]
        owners = [t for b, n in zip(batches, sizes) for t in (b.get("teacher_id") or [None] * n)]
        order_B = microbatches.length_order(whole)
        parts = microbatches.split_rollout(whole.rows(order_B), sizes)
        routed = any(t is not None for t in owners)
        records = []
        for r, rows in zip(parts, order_B.split(sizes)):  # each micro-batch's rows, as sampling places
            rows = rows.tolist()
            records.append(
                record_of(
                    r,
                    s.eos_token_ids,
                    rows,
                    [answers[i] for i in rows],
                    [owners[i] for i in rows] if routed else None,
                )
            )
        return records

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
