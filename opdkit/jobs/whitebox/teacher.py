"""The white-box run's teacher when it is served (`teacher_server`, `opd.teachers.served`): its head checked
against the server before training, what its states cost, and `teacher_server: local`'s server around the run
(`around_run`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from opdkit.config import ConfigError
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.jobs.whitebox.inputs import Prepared
from opdkit.models import load_model
from opdkit.opd.teachers import served, sets, topk
from opdkit.opd.teachers.base import Teacher
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir, print0
from opdkit.run.launch import under_external_launcher

SERVED_CHECK_FILE = "teacher_server.json"  # what the start check of a served teacher found


def served_teacher(cfg: WhiteboxConfig, prep: Prepared, run: RunDir, dtype: torch.dtype) -> Teacher:
    """`teacher_server`: the teacher's head alone (in `dtype`, as an in-process teacher's), its states from
    the server, checked before training (`served.job_teacher`); the check is kept in the run folder, and a
    resume against another served model than the run's first is refused (`served.check_same_teacher`). With
    `teacher_logprobs` topk:K, the generation server's top-K log-probabilities instead (`topk.TopKTeacher`:
    no head, an approximate divergence, said so at the start and in every logged step)."""
    if cfg.topk():  # teacher_logprobs topk:K: a generation server's top-K, no head here
        teacher, report = topk.job_topk_teacher(cfg, prep.tokenizer)
    else:
        teacher, report = served.job_teacher(cfg, prep.teacher_reads, dtype)
    saved = run.path / SERVED_CHECK_FILE
    if cfg.resume and saved.exists():
        served.check_same_teacher(json.loads(saved.read_text()), report, cfg.teacher_server_dtype)
    elif run.writer:
        atomic_write_text(saved, json.dumps(report.as_dict(), indent=1))
    gap = f"state gap {report.state_gap:.1e}" if report.state_gap == report.state_gap else "no state check"
    tokenizer = "tokenizer checked" if report.tokenizer_checked else "tokenizer not checked (server has none)"
    if cfg.topk():
        print0(
            f"teacher {cfg.teacher_model} served by {report.url} ({report.served_name}) as top-{cfg.topk()} "
            f"log-probabilities: {tokenizer}; the divergence is APPROXIMATE (teacher_logprobs "
            f"{cfg.teacher_logprobs}: the rest of the vocabulary is one bin); this process holds none of it"
        )
        return teacher
    print0(
        f"teacher {cfg.teacher_model} served by {report.url} ({report.served_name}, "
        f"{cfg.teacher_server_dtype}): {tokenizer}, {gap}; this process holds its head only "
        f"({report.head_rows} x {report.hidden_size}, {report.head_source})"
    )
    return teacher


def several_teachers(cfg: WhiteboxConfig, prep: Prepared, device, dtype: torch.dtype) -> Teacher:
    """`teachers`: each loaded in process (in `dtype`, on `device`) or, with a server, its head alone and its
    states from there (checked as `teacher_server`'s are); routed by the data's `teacher_id` column
    (`sets.RoutedTeacher`) or, with `teacher_weights`, all of them on every row (`WeightedTeachers`). The
    trainer logs each one's divergence and refuses a resume with another set (its `teachers.json`)."""
    found: dict[str, torch.nn.Module] = {}
    longest = served.longest(cfg)  # with `environment`, a multi-turn episode at its longest
    for t in cfg.teacher_specs():
        if t.server:
            client = served.PoolingClient(t.server, dtype=cfg.teacher_server_dtype)
            teacher = served.ServedTeacher(
                client, served.load_head(t.model, dtype), served_dtype=cfg.teacher_server_dtype
            )
            teacher.check(tokenizer=prep.tokenizer, expect_name=t.model, min_model_len=longest)
            where = f"served by {t.server}, its head here"
        else:
            teacher, where = load_model(t.model, dtype, device), "in this process"
        found[t.id] = teacher
        print0(f"teacher {t.id}: {t.model}, {where}")
    weights = cfg.weights()
    if weights:
        print0("teachers weighted: loss = " + " + ".join(f"{w:g} D({k})" for k, w in weights.items()))
        return sets.WeightedTeachers(found, weights)
    print0(f"teachers routed by the data's teacher_id column: {', '.join(found)}")
    return sets.RoutedTeacher(found)


def served_facts(cfg: WhiteboxConfig, teacher) -> dict:
    """With `teacher_server`: the server and what its states cost this process (`served.TransferStats`);
    with `teachers`, their ids and weights."""
    if cfg.teachers:
        return {"teachers": [t.id for t in cfg.teacher_specs()], "teacher_weights": cfg.weights() or None}
    if not cfg.teacher_server:
        return {}
    stats = teacher.stats
    return {
        "teacher_server": teacher.client.url,
        "teacher_logprobs": cfg.teacher_logprobs + (" (approximate)" if cfg.topk() else ""),
        "teacher_transfer": {
            **dataclasses.asdict(stats),
            "bytes_per_token": round(stats.bytes_per_token(), 1),
        },
    }


@contextlib.contextmanager
def around_run(prep: Prepared) -> Iterator[Prepared]:
    """What lives around a whitebox run (`Job.around`): with `teacher_server: local`, the teacher's pooling
    server started on `teacher_gpus` (its log in a temporary folder, printed), the run on the other visible
    GPUs against its URL, the server stopped however the run ends; it yields the prepared run pointed at it,
    checked against it. Without CUDA the server runs on the CPU beside the training. Any other run: nothing
    around it, `prep` as it is."""
    cfg = prep.cfg
    if cfg.teacher_server != served.LOCAL:
        yield prep
        return
    if under_external_launcher():
        raise ConfigError(
            "teacher_server local starts one server for the run: start the run as one process (num_processes "
            "picks the training processes), not under torchrun; or start the server yourself, give its URL."
        )
    gpus = train = None
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        gpus, train = served.split_gpus(cfg.teacher_gpus, ids)
    log = Path(tempfile.mkdtemp(prefix="opdkit-teacher-")) / "teacher-server.log"
    where = "GPUs " + ",".join(gpus) if gpus else "the CPU"
    print0(f"teacher_server local: starting {cfg.teacher_model} on {where}")
    print0(f"  its log: {log}")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    key_before = os.environ.get(served.API_KEY_ENV)
    # A fresh key for this run's server, which only its own clients (this process, its forks) are given.
    os.environ[served.API_KEY_ENV] = secrets.token_urlsafe(32)
    try:
        with served.job_server(cfg, log, gpus, os.environ[served.API_KEY_ENV]) as server:
            prep = dataclasses.replace(prep, cfg=dataclasses.replace(cfg, teacher_server=server.url))
            served.check_job_server(prep.cfg, prep.teacher_reads)
            try:
                if train:
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(train)
                yield prep
            finally:
                if train:
                    if before is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = before
    finally:
        if key_before is None:
            os.environ.pop(served.API_KEY_ENV, None)
        else:
            os.environ[served.API_KEY_ENV] = key_before
