"""A teacher served elsewhere, exactly: its final hidden states over HTTP from a vLLM pooling server, its
output head here, so the divergence is the same chunked, full-vocabulary one as with a local teacher.

    client = PoolingClient("http://node7:8000")                  # `vllm serve <teacher> --runner pooling ...`
    teacher = ServedTeacher(client, load_head("Qwen/Qwen3-4B"))  # the head alone: V x H numbers
    report = teacher.check(tokenizer=tok, expect_name="Qwen/Qwen3-4B", min_model_len=4096)
    trainer = DistillTrainer(..., teacher_model=teacher)         # the trainer is unchanged
    teacher.prepare_step(rows)       # optional: the step's rows sent at once, before its micro-batches

`ServedTeacher` is a teacher kind (`teachers.base.Teacher`, extending `local.LocalTeacher`) and the module
this process holds of it: it presents `base_model(...).last_hidden_state` and `get_output_embeddings().weight`
as a model does, the first from the server, the second the head read from the checkpoint (`head.load_head`),
so the training process never loads the teacher's layers. H numbers
move per token instead of V logits (Qwen3-4B: 2,560 against 151,936), and nothing is truncated.

By idea: `client` (HTTP, retries, the server's key), `head` (the output head read alone from the
checkpoint), `teacher` (`ServedTeacher`: rows unpadded, requests in flight, states cached for the step, the
reference's gap on the first steps), `checks` (start checks, the final-norm check, the probe's fingerprint),
`wiring` (a job's client, start check and teacher from its settings, and `teacher_server:
local`, the server a run starts itself). The names below are the package's: import them from here.
"""

from opdkit.opd.teachers.served.checks import (
    FINGERPRINT_TOLERANCE,
    PROBE_TEXT,
    ServedCheck,
    ServedTeacherMismatch,
    check_same_teacher,
    check_server,
    probe_logprobs,
    probe_text,
    state_gap,
)
from opdkit.opd.teachers.served.client import (
    API_KEY_ENV,
    PoolingClient,
    ServerClient,
    TeacherServerError,
    TransferStats,
    decode_pooling,
)
from opdkit.opd.teachers.served.head import TeacherHead, load_head
from opdkit.opd.teachers.served.teacher import CHECK_STEPS, ServedTeacher
from opdkit.opd.teachers.served.wiring import (
    LOCAL,
    check_job_server,
    job_client,
    job_server,
    job_teacher,
    local_server,
    longest,
    server_plan,
    split_gpus,
)

__all__ = [
    "API_KEY_ENV",
    "CHECK_STEPS",
    "FINGERPRINT_TOLERANCE",
    "LOCAL",
    "PROBE_TEXT",
    "PoolingClient",
    "ServedCheck",
    "ServedTeacher",
    "ServedTeacherMismatch",
    "ServerClient",
    "TeacherHead",
    "TeacherServerError",
    "TransferStats",
    "check_job_server",
    "check_same_teacher",
    "check_server",
    "decode_pooling",
    "job_client",
    "job_server",
    "job_teacher",
    "load_head",
    "local_server",
    "longest",
    "probe_logprobs",
    "probe_text",
    "server_plan",
    "split_gpus",
    "state_gap",
]
