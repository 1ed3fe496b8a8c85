"""Teacher kinds behind one interface (`base.Teacher`), one home each: `local` (in this process: a Hugging
Face model; antidistillation's `ads.teacher.ADSTeacher`, which presents its ADS logits as states and a head,
is a kind of it where it lives), `served` (exact, its states from a vLLM pooling server: client, head, checks,
job wiring), `topk` (its top-K log-probabilities from a generation server: approximate), `cross` (another
tokenizer: the re-tokenized batch, the alignment and GOLD's divergence), `sets` (several teachers, routed or
weighted), `defended` (a teacher in process whose scores reach the loss through a defence: top-K, the scored
token's alone, rounded, noised). A job builds the kind it wants; `of` takes a kind as it is and any other
module as a teacher in process; the trainer asks the kind for everything else.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from opdkit.models import check_tokenizers
from opdkit.opd.teachers.base import Teacher
from opdkit.opd.teachers.cross import CrossTokenizerTeacher, differ
from opdkit.opd.teachers.local import LocalTeacher


def of(
    model: torch.nn.Module | Teacher,
    tokenizer: PreTrainedTokenizerBase,
    teacher_tokenizer: PreTrainedTokenizerBase | None = None,
    settings=None,
) -> Teacher:
    """The teacher kind of `model` (a `Teacher` as it is, any other module a `LocalTeacher`); read through
    another tokenizer where `teacher_tokenizer` is another vocabulary than `tokenizer` (`settings`: the
    `crosstok_*` fields)."""
    kind = model if isinstance(model, Teacher) else LocalTeacher(model)
    if differ(tokenizer, teacher_tokenizer):
        return CrossTokenizerTeacher(kind, tokenizer, teacher_tokenizer, settings)
    check_tokenizers(tokenizer, teacher_tokenizer or tokenizer)
    return kind
