"""02 with `teacher_server`: a tiny run against a pooling server (tests/helpers.py's stub: the tiny
teacher's states over HTTP) takes the in-process teacher's first update, checked against TRL's loss on full
logits; an unreachable or wrong server is refused before anything is written; a server gone mid-run stops the
run with one error and the run resumes; the memory plan holds the head, not the teacher. Through tool turns
(`environment`), the served teacher reads each transcript whole and takes the in-process first update.
tests/test_opd_teachers_served_vllm.py runs the same job against a real vLLM server."""

from __future__ import annotations

import json
import os
import secrets

import pytest
import torch
from helpers import (
    TOOL_RUN,
    StubPoolingServer,
    assert_grads_close,
    direct_gradient,
    episodes,
    run_tiny,
    tool_turns,
)
from transformers import AutoModelForCausalLM, TrainerCallback

from opdkit import tiny
from opdkit.config import ConfigError, load_config
from opdkit.jobs import whitebox
from opdkit.models import load_tokenizer
from opdkit.opd.callbacks import GradientDump
from opdkit.opd.teachers import served
from opdkit.opd.teachers.served import wiring
from opdkit.opd.teachers.served.head import load_head
from opdkit.run.lifecycle import RunFailed
from opdkit.run.server import free_port

SMALL = dict(per_device_train_batch_size=8, subset_size=16, rollout_max_new_tokens=16)


@pytest.fixture(scope="module")
def stub():
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).eval()
    with StubPoolingServer(teacher, "tiny:teacher", load_tokenizer("tiny:student")) as s:
        yield s


def served_over(stub, **over) -> dict:
    return {"teacher_server": stub.url, "teacher_server_dtype": "float32", **SMALL, **over}


def test_a_served_teacher_takes_the_in_process_teachers_first_update(tmp_path, stub):
    local = run_tiny(tmp_path, "local", [GradientDump(str(tmp_path / "local.pt"))], **SMALL)
    run = run_tiny(tmp_path, "served", [GradientDump(str(tmp_path / "served.pt"))], **served_over(stub))
    got, want = torch.load(tmp_path / "served.pt"), torch.load(tmp_path / "local.pt")
    # The same rollouts, so the same gradient as TRL's loss on the in-process teacher's full logits ...
    assert_grads_close(got, direct_gradient(run.path))
    # ... and as the in-process run's, to rounding (the served rows run unpadded, one by one).
    for name, w in want.items():
        assert float((got[name] - w).norm() / w.norm()) < 1e-5, name
    loss = [r["loss"] for r in (local, run) for r in [r.read_jsonl()[0]]]
    assert loss[1] == pytest.approx(loss[0], rel=1e-5)
    summary = run.read_summary()
    assert summary["teacher_server"] == stub.url and summary["teacher_accuracy"] is None
    assert summary["teacher_transfer"]["tokens"] > 0 and summary["teacher_transfer"]["retries"] == 0
    check = json.loads((run.path / whitebox.teacher.SERVED_CHECK_FILE).read_text())
    assert check["url"] == stub.url and check["tokenizer_checked"] and check["state_gap"] < 1e-5


def test_a_served_teacher_takes_the_in_process_first_update_through_tool_turns(tmp_path, stub):
    """Multi-turn episodes of the tiny tool world (tool calls, the calculator's results): the server is sent
    each transcript whole (the prompt, the student's turns, the template's and the tools' tokens), the states
    that predict the student's tokens are kept, and the first update is the in-process teacher's (relative
    1e-5), itself TRL's loss on full logits over the student's turns."""
    over = {**TOOL_RUN, "per_device_train_batch_size": 4}
    local = run_tiny(tmp_path, "local", [GradientDump(str(tmp_path / "local.pt"))], **over)
    stub.pooling_requests.clear()
    run = run_tiny(
        tmp_path, "served", [GradientDump(str(tmp_path / "served.pt"))], **served_over(stub, **over)
    )
    rows = episodes(run.path)
    assert sorted(rows) == sorted(episodes(local.path)) and len(rows) == 4
    assert all(tool_turns(mask) >= 1 for _, mask in rows), "every episode calls the calculator"
    sent = [r for p in stub.pooling_requests[1:] for r in p["input"]]  # after the start check's probe
    assert sorted(sent) == sorted(list(ids) for ids, _ in rows)
    got, want = torch.load(tmp_path / "served.pt"), torch.load(tmp_path / "local.pt")
    assert_grads_close(got, direct_gradient(run.path, student="tiny:teacher-tools"))
    for name, w in want.items():
        assert float((got[name] - w).norm() / w.norm()) < 1e-5, name
    loss = [r.read_jsonl()[0]["loss"] for r in (local, run)]
    assert loss[1] == pytest.approx(loss[0], rel=1e-5)


def test_a_served_teachers_context_and_plan_count_an_episode_at_its_longest(tmp_path, stub):
    """With `environment` the server must hold the longest prompt and an episode at its longest
    (`episode_max_tokens`, else `max_turns` x `rollout_max_new_tokens`): the stub's 256 positions refuse
    96 + 200 before anything is written; the plan's states are counted at that length."""
    over = {**TOOL_RUN, "episode_max_tokens": 200}
    with pytest.raises(ConfigError, match="serves at most 256 tokens per sequence but the run needs 296"):
        run_tiny(tmp_path, "r", **served_over(stub, **over))
    assert not (tmp_path / "r").exists()
    for episode_max_tokens, length in ((200, 96 + 200), (0, 96 + 2 * 100)):
        cfg = load_config(
            whitebox.WhiteboxConfig,
            "tiny",
            {**TOOL_RUN, "episode_max_tokens": episode_max_tokens, "teacher_server": "http://x"},
        )
        assert served.longest(cfg) == length
        rows = {r.component: r.bytes for r in whitebox.memory_plan(cfg, None).plan.rows}
        hidden = load_head("tiny:teacher", torch.float32).weight_VH.shape[1]
        assert rows["served teacher states"] == cfg.per_device_train_batch_size * length * hidden * 4


@pytest.mark.parametrize(
    "server,match",
    [("dead", "does not answer"), ("tiny-student", "not the teacher"), ("ftp", "give the URL")],
)
def test_a_server_that_is_down_or_serves_another_model_is_refused_before_anything_is_written(
    tmp_path, stub, server, match
):
    url = {"dead": f"http://127.0.0.1:{free_port()}", "ftp": "ftp://x", "tiny-student": stub.url}[server]
    name = stub.name
    if server == "tiny-student":
        stub.name = stub.root = server
    try:
        with pytest.raises(ConfigError, match=match):
            run_tiny(tmp_path, "r", **served_over(stub, teacher_server=url))
    finally:
        stub.name = stub.root = name
    assert not (tmp_path / "r").exists()


class StopServing(TrainerCallback):
    """The server fails every request from the end of step `at` on (it has gone)."""

    def __init__(self, stub, at: int):
        self.stub, self.at = stub, at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.stub.fail_next = 10**6


def test_a_server_gone_mid_run_stops_it_with_one_error_and_the_run_resumes(tmp_path, stub, monkeypatch):
    def quick(cfg, **kw):  # one retry, no backoff to speak of
        return served.PoolingClient(cfg.teacher_server, dtype="float32", retries=1, backoff_s=0.01)

    monkeypatch.setattr(wiring, "job_client", quick)  # where check_job_server and job_teacher read it
    over = served_over(stub, max_steps=2, checkpoint_every=1, subset_size=32)
    with pytest.raises(RunFailed, match=f"{stub.url} did not answer.*resume.*traceback: .*error.txt") as e:
        run_tiny(tmp_path, "r", [StopServing(stub, 1)], **over)
    stub.fail_next = 0
    assert isinstance(e.value.__cause__, served.TeacherServerError) and "\n" not in str(e.value)
    assert "TeacherServerError" in (tmp_path / "r" / "error.txt").read_text()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"].startswith("failed: TeacherServerError")
    assert (tmp_path / "r" / "checkpoints" / "checkpoint-1").is_dir()
    again = run_tiny(tmp_path, "r", **over, resume=True)
    assert again.read_summary()["steps"] == 2 and [r["step"] for r in again.read_jsonl()][-1] == 2


def test_a_served_teacher_behind_a_key_gets_it_and_nothing_written_holds_it(
    tmp_path, stub, monkeypatch, capfd
):
    """`OPDKIT_TEACHER_API_KEY` goes to the server on every request, and into no file of the run folder
    (config.yaml, summary, logs, the tracker's files) nor its output."""
    key = "sk-" + secrets.token_hex(16)
    monkeypatch.setenv(served.API_KEY_ENV, key)
    stub.api_key, stub.authorizations = key, []
    try:
        run = run_tiny(tmp_path, "r", **served_over(stub, max_steps=1, report_to="tensorboard"))
    finally:
        stub.api_key = ""
    assert stub.authorizations and set(stub.authorizations) == {f"Bearer {key}"}
    files = [p for p in run.path.rglob("*") if p.is_file()]
    assert any("events.out.tfevents" in p.name for p in files)  # the tracker's own files are among them
    assert [p for p in files if key.encode() in p.read_bytes()] == []
    out = capfd.readouterr()
    assert key not in out.out and key not in out.err


def test_the_plan_of_a_served_run_holds_the_head_and_not_the_teacher():
    cfg = load_config(whitebox.WhiteboxConfig, "tiny")
    local = whitebox.memory_plan(cfg, None).plan
    far = whitebox.memory_plan(
        load_config(whitebox.WhiteboxConfig, "tiny", {"teacher_server": "http://x"}), None
    )
    rows = {r.component: r.bytes for r in far.plan.rows}
    assert "teacher weights" in {r.component for r in local.rows} and "teacher weights" not in rows
    head = load_head("tiny:teacher", torch.float32).weight_VH
    assert rows["teacher head (served teacher)"] == head.numel() * 4
    # one micro-batch's states, padded, in the head's dtype (the step's wait in host memory)
    length = cfg.max_prompt_length + cfg.rollout_max_new_tokens
    assert rows["served teacher states"] == cfg.per_device_train_batch_size * length * head.shape[1] * 4
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    assert local.row("teacher weights").bytes == sum(p.numel() for p in teacher.parameters()) * 4


class FakeServer:
    """Stands in for `served.job_server`'s server process: the stub's URL, and whether it ran and stopped."""

    def __init__(self, stub):
        self.url, self.events = stub.url, []

    def __enter__(self):
        self.events.append("start")
        return self

    def __exit__(self, *exc):
        self.events.append("stop")


@pytest.mark.parametrize("fails", [False, True], ids=["ends", "fails"])
def test_a_local_teacher_server_runs_for_the_run_and_stops_however_it_ends(
    tmp_path, stub, monkeypatch, fails
):
    fake = FakeServer(stub)
    asked = []
    keys = []

    def job_server(cfg, log, gpus, api_key):  # the stub asks for the run's fresh key from now on
        stub.api_key = api_key
        keys.append(api_key)
        return asked.append(gpus) or fake

    monkeypatch.setattr(served, "job_server", job_server)
    monkeypatch.delenv(served.API_KEY_ENV, raising=False)
    if fails:
        stub.fail_next = 10**6  # the server refuses from the start check on
    try:
        if fails:
            with pytest.raises(ConfigError, match="does not answer"):
                run_tiny(tmp_path, "r", **served_over(stub, teacher_server="local"))
        else:
            run = run_tiny(tmp_path, "r", **served_over(stub, teacher_server="local"))
            assert run.read_summary()["teacher_server"] == stub.url
    finally:
        stub.fail_next, stub.api_key = 0, ""
    assert fake.events == ["start", "stop"] and asked == [None]  # no CUDA here: the server on the CPU
    # a fresh key, given to the run's own client (every request carried it), and gone with the server
    assert len(keys) == 1 and len(keys[0]) >= 32 and served.API_KEY_ENV not in os.environ
    assert set(stub.authorizations[-3:]) == {f"Bearer {keys[0]}"}


def test_teacher_gpus_split_the_visible_gpus():
    assert served.split_gpus("2,3", ["0", "1", "4", "5"]) == (["4", "5"], ["0", "1"])
    for bad, match in (
        ("", "needs GPUs"),
        ("4", "needs GPUs"),
        ("0,1", "every visible GPU"),
        ("a", "indices"),
    ):
        with pytest.raises(ConfigError, match=match):
            served.split_gpus(bad, ["0", "1"])


def test_teacher_logprobs_topk_is_refused_without_a_server_or_at_another_temperature():
    """`teacher_logprobs` (ServedSettings): exact or topk:K; topk needs a server and kl_temperature 1, each
    refusal one ConfigError line before anything runs. A local server for it is a generation server."""
    load = lambda **over: load_config(whitebox.WhiteboxConfig, "tiny", over)  # noqa: E731
    assert load().topk() is None and load(teacher_server="http://x", teacher_logprobs="topk:20").topk() == 20
    for over, match in (
        ({"teacher_logprobs": "topk:20"}, "set teacher_server"),
        ({"teacher_logprobs": "top20", "teacher_server": "http://x"}, "expected exact, or topk:K"),
        ({"teacher_logprobs": "topk:0", "teacher_server": "http://x"}, "expected exact, or topk:K"),
        (
            {"teacher_logprobs": "topk:5", "teacher_server": "http://x", "kl_temperature": 2.0},
            "kl_temperature 1",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            load(**over)
    cfg = load(teacher_server="local", teacher_logprobs="topk:7")
    cmd = served.job_server(cfg, "/tmp/x.log").command
    assert cmd[cmd.index("--runner") + 1] == "generate" and cmd[cmd.index("--max-logprobs") + 1] == "7"


def test_whitebox_with_two_weighted_teachers_logs_each_and_refuses_a_resume_with_another_set(tmp_path):
    """02 tiny with `teachers` (the tiny teacher and the tiny student as a second teacher) and
    `teacher_weights` 0.7 / 0.3: every step logs divergence/a and divergence/b (0: b is the student), the loss
    is 0.7 D(a) + 0.3 D(b), the summary names the set, and a resume
    with b replaced stops with one line; routed teachers on data without a teacher_id column, and weights
    naming other ids, are refused before anything is written."""
    two = {"teachers": "a=tiny:teacher,b=tiny:student", "teacher_weights": "a=0.7,b=0.3", **SMALL}
    run = run_tiny(tmp_path, "r", **two)
    step = run.read_jsonl()[0]
    # b is the student itself: its divergence is 0, the loss 0.7 of a's (per token)
    assert step["divergence/a"] > 0 and step["divergence/b"] == pytest.approx(0.0, abs=1e-6)
    assert step["loss"] == pytest.approx(0.7 * step["divergence/a"], rel=1e-4)
    assert run.read_summary()["teachers"] == ["a", "b"]
    assert (run.path / "checkpoints" / "teachers.json").exists()
    # another set by its settings: refused by the run folder's settings check; by its weights (the same
    # names, other models): by the trainer's fingerprints (tests/test_opd_teachers_sets_trainer.py)
    with pytest.raises(ConfigError, match="differ from the run.*'teachers'"):
        run_tiny(tmp_path, "r", **{**two, "teachers": "a=tiny:teacher,b=tiny:teacher", "resume": True})
    with pytest.raises(ConfigError, match="teacher_id column"):
        run_tiny(tmp_path, "routed", teachers="a=tiny:teacher,b=tiny:student")
    with pytest.raises(ConfigError, match="one weight per teacher id"):
        run_tiny(tmp_path, "w", teachers="a=tiny:teacher,b=tiny:student", teacher_weights="a=1,c=1")


def test_teacher_server_reference_logs_the_teacher_logprob_gap_on_the_first_steps(tmp_path, stub):
    """`teacher_server_reference`: the teacher in process too, compared with the served states x head on the
    first two steps (the stub serves the tiny teacher's own states: the gap is rounding)."""
    run = run_tiny(tmp_path, "r", **served_over(stub, teacher_server_reference=True, max_steps=3))
    gaps = [r["teacher_logprob_gap"] for r in run.read_jsonl() if "loss" in r]
    assert gaps[0] < 1e-5 and gaps[1] < 1e-5 and gaps[2] is None, gaps


def test_a_local_servers_own_plan_counts_its_weights_and_kv_cache_per_gpu():
    """`served.server_plan`: the teacher's weights over the tensor-parallel GPUs and the KV cache vLLM makes
    of the rest of its 0.9 share, counted here from the tiny teacher's own config and parameters."""
    cfg = load_config(whitebox.WhiteboxConfig, "tiny", {"teacher_server": "local", "teacher_gpus": "0,1"})
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    c = teacher.config
    weights = sum(p.numel() for p in teacher.parameters()) * 2 / 2  # bf16, over 2 GPUs
    per_token = c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 2 / 2  # K and V, bf16
    kv = 0.9 * 80e9 - weights
    line = served.server_plan(cfg, 80)
    assert f"KV cache {kv / 1e9:.2f} GB" in line and f"= {int(kv // per_token):,} tokens" in line, line
    assert "80 GB GPU x 2 (tensor parallel)" in line and "pooling" in line
    topk_cfg = {"teacher_server": "local", "teacher_logprobs": "topk:20"}
    assert "generation" in served.server_plan(load_config(whitebox.WhiteboxConfig, "tiny", topk_cfg), None)


def test_a_served_teacher_with_another_tokenizer_takes_the_in_process_first_update(tmp_path, capsys):
    """tiny:teacher-bpe served (the stub reads its own tokens): the run's first update is the in-process
    cross-tokenizer run's, the start checks the server's tokenizer against the teacher's (not the
    student's), and `teacher_server_reference` compares the teacher's own tokens' log-probabilities."""
    bpe = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher-bpe")).eval()
    cross = dict(SMALL, teacher_model="tiny:teacher-bpe", crosstok_hybrid=True, max_steps=2)
    local = run_tiny(tmp_path, "local", [GradientDump(str(tmp_path / "local.pt"))], **cross)
    with StubPoolingServer(bpe, "teacher-bpe", load_tokenizer("tiny:teacher-bpe")) as stub:
        over = dict(cross, teacher_server=stub.url, teacher_server_dtype="float32")
        over["teacher_server_reference"] = True
        run = run_tiny(tmp_path, "served", [GradientDump(str(tmp_path / "served.pt"))], **over)
    assert "accuracy before: teacher served, not measured here" in capsys.readouterr().out
    got, want = torch.load(tmp_path / "served.pt"), torch.load(tmp_path / "local.pt")
    for name, w in want.items():
        assert float((got[name] - w).norm() / w.norm()) < 1e-5, name
    rows = [r for r in run.read_jsonl() if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(local.read_jsonl()[0]["loss"], rel=1e-5)
    assert all(r["teacher_logprob_gap"] < 1e-5 for r in rows), rows
    check = json.loads((run.path / whitebox.teacher.SERVED_CHECK_FILE).read_text())
    assert check["tokenizer_checked"] and check["state_gap"] < 1e-5
    # a server reading the student's tokens for this teacher, and top-K ids of another vocabulary: refused
    with StubPoolingServer(bpe, "teacher-bpe", load_tokenizer("tiny:student")) as stub:
        with pytest.raises(ConfigError, match="token ids would mean different things"):
            run_tiny(tmp_path, "x", **dict(cross, teacher_server=stub.url))
    with pytest.raises(ConfigError, match="needs a teacher with the student's tokenizer"):
        run_tiny(tmp_path, "y", **dict(cross, teacher_server="http://127.0.0.1:9", teacher_logprobs="topk:5"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
