"""The calls every teacher kind answers, so that `DistillTrainer` names none of them.

    teacher = teachers.of(teacher_model, student_tokenizer, teacher_tokenizer, args)  # a module or a kind
    teacher.start(student, tokenizer, args)        # its checks at start (vocabularies, settings)
    teacher.place(device, shard)                   # what this process holds, on the device (sharded)
    own = teacher.inputs(record)                   # per micro-batch, when the step's rollouts arrive
    teacher.prepare([(record, own), ...], step)    # once per step: e.g. a served teacher's requests
    n = teacher.loss_count(record, own)            # what the step's summed loss is divided by (its share)
    part = teacher.score(record, own, fwd, pred_BT)                        # the teacher side (no gradient)
    parts = teacher.student_divergence(student, fwd, pred_BT, part, given)  # the student side, in its forward
    out, sums = teacher.output(parts, record, part)  # a `DivergenceOutput`, and the kind's step sums

A micro-batch reaches a teacher as a `source.RolloutRecord` (token rows and the loss mask), plus the
teacher's own inputs of it (`inputs`: a teacher with another tokenizer re-tokenizes and aligns it there).
`pred_BT` marks the positions whose state predicts a loss token (the loss mask shifted by one); `fwd` is the
student's forward arguments over the record's rows. What `score` returns is the kind's own business: final
hidden states and a head, top-K ids and log-probabilities, another tokenizer's states and an alignment; its
`student_divergence` is the one function that reads it. Besides: `exact` (False: an approximate divergence,
labelled in the metrics), `fingerprint` (what a run saves and compares at a resume), `metrics` (its own
columns of metrics.jsonl), `name` (how the run's log and its errors call it).

Each kind is one class in one module or package of `opd.teachers`, holding its client, head and checks. A
kind that holds a module of its own (a served teacher's head, a set's teachers) is that module too
(`module` is itself), so a job builds the kind and hands it to the trainer as it is; any other module with
states and a head is taken as a teacher in process (`teachers.of`). Adding a kind is one module here (a
`Teacher` subclass) and its test.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from opdkit.models import TokenizerMismatch
from opdkit.opd.loss import DivergenceOutput
from opdkit.rollout.source import RolloutRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


@dataclass(frozen=True)
class DivergenceInputs:
    """A micro-batch's runtime inputs of every divergence (from `OPDSettings` and the record): generalized
    JSD's `beta`, the temperature both distributions are compared at, the compared vocabulary (the student
    tokenizer's size), the rows per chunk, and the sampled token each predicting position was followed by
    (the engine gap's, None without it); with `async_correction` truncated, the sampler's log-probability
    of each of those tokens (`sampling_logprobs_N`) and the cap of the importance weights
    (`loss.chunked_divergence`)."""

    beta: float
    temperature: float
    vocab_size: int
    chunk_size: int
    target_ids_N: torch.Tensor | None = None
    sampling_logprobs_N: torch.Tensor | None = None
    ratio_cap: float = math.inf

    def one_vocabulary(self) -> dict:
        """`loss.chunked_divergence`'s keywords (the importance weights' only where they are asked for, so a
        teacher kind whose divergence has none is never handed them)."""
        out = dict(
            beta=self.beta,
            chunk_size=self.chunk_size,
            target_ids_N=self.target_ids_N,
            temperature=self.temperature,
            vocab_size=self.vocab_size,
        )
        if self.sampling_logprobs_N is not None:
            out.update(sampling_logprobs_N=self.sampling_logprobs_N, ratio_cap=self.ratio_cap)
        return out


# One micro-batch as a teacher's `prepare` sees it: the record and the teacher's own `inputs` of it.
Prepared = tuple[RolloutRecord, Any]


class Teacher(ABC):
    """One kind of teacher. `name`: how the run's log and errors call it; `module`: what this process holds
    of it (placed on the device by `place`, recorded in held/; None: nothing); `tokenizer`: its own tokenizer
    where it reads other tokens than the student's."""

    name: str
    exact: bool = True  # False: the loss is an approximation of the divergence, labelled as such
    gives_entropy: bool = True  # False: its divergence never forms the student's full rows (no entropy)
    # True: its divergence is `loss.chunked_divergence`'s, which takes the importance weights of stale
    # rollouts (`async_correction`); a kind with a divergence of its own refuses them.
    importance_weighted: bool = False
    module: torch.nn.Module | None
    tokenizer: PreTrainedTokenizerBase | None = None
    # Why the kind cannot read another tokenizer's rows (None: it can, through `cross.CrossTokenizerTeacher`).
    another_tokenizer_refusal: str | None = None

    def start(self, student: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args) -> None:  # noqa: B027
        """Checks before training that need the student, the tokenizer the teacher's rows are in, or the run's
        settings (`OPDArguments`); each failure one line. Most kinds check nothing more."""

    def place(self, device, shard: bool) -> None:
        """Put what this process holds on `device`; `shard`: a sharded run (FSDP over several processes)
        whose frozen teacher may be sharded like the student, where the kind holds layers."""
        self.module.to(device)

    def inputs(self, record: RolloutRecord) -> Any:
        """The teacher's own inputs of a micro-batch, made when the step's rollouts arrive (host work; None:
        it reads the record as it is)."""
        return None

    def saved(self, own: Any) -> dict[str, torch.Tensor]:
        """The tensors of its `inputs` that save_rollouts keeps beside the record (none: nothing of its
        own)."""
        return {}

    def prepare(self, batches: list[Prepared], step: int) -> None:
        """Once per step (`step`: its 0-based index, as `RolloutSource.next_step`'s), before its
        micro-batches: the token rows it reads (`reads`) handed to `prepare_batches`."""
        self.prepare_batches([reads(record) for record, _ in batches], step)

    def prepare_batches(self, batches: list[dict], step: int) -> None:  # noqa: B027 - in process: no wait
        """The step's micro-batches as the teacher reads them (`reads`' dicts), before it scores them: e.g. a
        served teacher sends their rows to its server now."""

    def loss_count(self, record: RolloutRecord, own: Any) -> torch.Tensor:
        """What the step's summed loss is divided by, this micro-batch's share: its loss tokens."""
        return record.loss_mask_BT.sum()

    @abstractmethod
    def score(self, record: RolloutRecord, own: Any, fwd: dict, pred_BT: torch.Tensor) -> Any:
        """The divergence's teacher side for a micro-batch, without gradients."""

    @abstractmethod
    def student_divergence(
        self, student: PreTrainedModel, fwd: dict, pred_BT: torch.Tensor, part: Any, given: DivergenceInputs
    ) -> tuple[torch.Tensor | None, ...]:
        """The student's side, run as the student's forward (`sharding.call_inside_forward`): its backbone
        over `fwd`, its states where `pred_BT` marks, the divergence against `part`. A tuple of tensors
        (summed divergence, per-token divergence, student entropy, student log-probability of each target
        token or None, then anything the kind's `output` reads), not a dataclass, so that the wrapper finds
        the output it hooks the backward pass on."""

    def output(
        self, parts: tuple, record: RolloutRecord, part: Any
    ) -> tuple[DivergenceOutput, torch.Tensor | None]:
        """The micro-batch's `DivergenceOutput`, and its share of the kind's step sums (`new_sums`) if
        any."""
        return DivergenceOutput(*parts[:4]), None

    def new_sums(self, device) -> torch.Tensor | None:
        """The kind's own per-step sums, zero, summed over micro-batches and processes (None: none)."""
        return None

    def metrics(self, sums: list[float] | None) -> dict:
        """The kind's own columns of a step's metrics.jsonl record, from its summed `new_sums`."""
        return {}

    def fingerprint(self, probe_ids: list[int]) -> dict | None:
        """What a run saves beside its checkpoints and compares at a resume (None: nothing here; a single
        served teacher's job checks its server itself)."""
        return None

    def check_same(self, saved: dict, now: dict) -> None:  # noqa: B027 - without a fingerprint: never called
        """Refuse a resume whose `fingerprint` differs from the saved one (one line)."""

    def describe(self, name: str) -> str | None:
        """One line for the run's log about the teacher `name`, where the kind has something to say."""
        return None


def reads(record: RolloutRecord) -> dict:
    """A micro-batch's token rows as a teacher's `prepare_step` takes them: `input_ids`, `attention_mask`,
    `pred_BT` (the positions whose states the divergence reads) and each row's `teacher_id` (None: none)."""
    return {
        "input_ids": record.input_ids_BT,
        "attention_mask": record.attention_mask_BT,
        "pred_BT": record.predicting_BT(),
        "teacher_id": record.teacher_ids,
    }


def student_states(
    student: PreTrainedModel, fwd: dict, pred_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's final hidden states at the positions `pred_BT` marks, and its head weight: what every
    kind's `student_divergence` starts from (run inside the student's forward, where an FSDP head is
    whole)."""
    return student.base_model(**fwd).last_hidden_state[pred_BT], student.get_output_embeddings().weight


def check_head_covers(name: str, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """A model's head covers its tokenizer (models may pad their vocabulary beyond it)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    if vocab < len(tokenizer):
        raise TokenizerMismatch(
            f"the {name} has {vocab} output rows but the tokenizer has {len(tokenizer)} tokens; "
            "the model and tokenizer do not belong together."
        )
