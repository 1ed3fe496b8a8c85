"""Teacher kinds behind one interface (`base.Teacher`): `local` (in this process: a Hugging Face model, or
antidistillation's `ADSTeacher`, which presents its ADS logits as states and a head), `served` (exact, its
states from a vLLM pooling server), `topk` (its top-K log-probabilities: approximate), `cross` (another
tokenizer), `sets` (several teachers, routed or weighted). `of` picks the kind of a teacher model; the
trainer asks the kind for everything else.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from opdkit.models import check_tokenizers
from opdkit.opd.crossteacher import differ
from opdkit.opd.mixture import RoutedTeacher, WeightedTeachers
from opdkit.opd.served import ServedTeacher
from opdkit.opd.teachers.base import Teacher
from opdkit.opd.teachers.cross import CrossTokenizerTeacher
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.opd.teachers.served import ServedExact
from opdkit.opd.teachers.sets import Routed, Weighted
from opdkit.opd.teachers.topk import TopK
from opdkit.opd.topk import TopKTeacher

# A teacher module's class -> its kind; any other module with states and a head is a teacher in process.
# (Classes imported by name: this package's own `served` and `topk` modules are the kinds.)
KINDS = {
    ServedTeacher: ServedExact,
    TopKTeacher: TopK,
    RoutedTeacher: Routed,
    WeightedTeachers: Weighted,
}


def of(
    model: torch.nn.Module | Teacher,
    tokenizer: PreTrainedTokenizerBase,
    teacher_tokenizer: PreTrainedTokenizerBase | None = None,
    settings=None,
) -> Teacher:
    """The kind of `model` (a `Teacher` is taken as it is); read through another tokenizer where
    `teacher_tokenizer` is another vocabulary than `tokenizer` (`settings`: the `crosstok_*` fields)."""
    kind = model if isinstance(model, Teacher) else KINDS.get(type(model), LocalTeacher)(model)
    if differ(tokenizer, teacher_tokenizer):
        return CrossTokenizerTeacher(kind, tokenizer, teacher_tokenizer, settings)
    check_tokenizers(tokenizer, teacher_tokenizer or tokenizer)
    return kind
