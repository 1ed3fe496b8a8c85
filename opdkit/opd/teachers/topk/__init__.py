"""A teacher given as its top-K log-probabilities (`teacher_logprobs: topk:K`): `divergence` (the approximate
top-K divergence, pure maths: what it computes and how it is biased) and `teacher` (`TopKTeacher`, the kind,
with the client that asks a vLLM generation server for the log-probabilities). The names below are the
package's: import them from here.
"""

from opdkit.opd.teachers.topk.divergence import (
    TAIL_FLOOR,
    TEMPERATURE_REFUSAL,
    bins_divergence,
    chunked_topk_divergence,
    coarse_student,
    coarse_teacher,
    teacher_topk,
    topk_divergence,
)
from opdkit.opd.teachers.topk.teacher import (
    PromptLogprobsClient,
    TopKTeacher,
    job_topk_teacher,
    student_topk_divergence,
)

__all__ = [
    "TAIL_FLOOR",
    "TEMPERATURE_REFUSAL",
    "PromptLogprobsClient",
    "TopKTeacher",
    "bins_divergence",
    "chunked_topk_divergence",
    "coarse_student",
    "coarse_teacher",
    "job_topk_teacher",
    "student_topk_divergence",
    "teacher_topk",
    "topk_divergence",
]
