"""The served teacher without vLLM: a stub pooling server in a thread (transformers' tiny teacher, base64 over
HTTP) checks the client's decoding, retries and errors, the state check, and that `DistillTrainer` with a
`ServedTeacher` computes the in-process teacher's loss and gradient. tests/test_opd_teachers_served_vllm.py
does the same against a real vLLM server."""

from __future__ import annotations

import base64
import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.teachers import served
from opdkit.opd.teachers.base import reads
from opdkit.opd.teachers.served import teacher as served_teacher
from opdkit.opd.teachers.served.head import load_head
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import sampling, source
from opdkit.tasks import tiny as task


class StubPoolingServer:
    """A pooling server in a thread: POST /pooling answers each row's final hidden states from `model` (one
    unpadded forward per row) as base64 float32 or JSON floats, GET /v1/models names `name`, POST /tokenize
    uses `tokenizer`, POST /v1/completions answers `prompt_logprobs` as a vLLM generation server does (each
    position's top-K log-probabilities from `model`'s logits, the actual token beside them with its rank;
    kept in `completion_requests`). `fail_next` requests get `fail_status`; `delay_s` delays every /pooling
    answer. With `api_key` every request but GET /health needs `Authorization: Bearer <api_key>` (401
    without); the Authorization headers received are kept in `authorizations`."""

    def __init__(self, model, name: str = "tiny-teacher", tokenizer=None, root: str | None = None):
        self.model, self.name, self.tokenizer, self.root = model, name, tokenizer, root or name
        self.fail_next, self.fail_status, self.delay_s = 0, 503, 0.0
        self.pooling_requests: list[dict] = []
        self.completion_requests: list[dict] = []
        self.transform = None  # states -> states, to serve something else than the model's final states
        self.api_key, self.authorizations = "", []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def refused(self) -> bool:
                stub.authorizations.append(self.headers.get("Authorization", ""))
                if stub.api_key and stub.authorizations[-1] != f"Bearer {stub.api_key}":
                    self._send(401, {"error": "Unauthorized"})
                    return True
                return False

            def do_GET(self):
                if self.path != "/health" and self.refused():
                    return
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": stub.name, "root": stub.root, "max_model_len": 256}]})
                else:
                    self._send(404, {"error": {"message": "no such path"}})

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.refused():
                    return
                if stub.fail_next:
                    stub.fail_next -= 1
                    self._send(stub.fail_status, {"error": {"message": "stub failure"}})
                    return
                if self.path == "/tokenize":
                    if stub.tokenizer is None:
                        self._send(404, {"error": {"message": "no tokenizer"}})
                        return
                    ids = stub.tokenizer(payload["prompt"], add_special_tokens=False)["input_ids"]
                    self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": 256})
                    return
                if self.path == "/v1/completions":
                    stub.completion_requests.append(payload)
                    k = payload["prompt_logprobs"]
                    choices = [
                        {"index": i, "text": "", "prompt_logprobs": prompt_logprobs(stub.model, row, k)}
                        for i, row in enumerate(payload["prompt"])
                    ]
                    self._send(200, {"choices": choices})
                    return
                stub.pooling_requests.append(payload)
                if max(max(r) for r in payload["input"]) >= stub.model.config.vocab_size:
                    self._send(400, {"error": {"message": "Token id is out of vocabulary"}})
                    return
                assert payload["task"] == "token_embed" and payload["use_activation"] is False
                time.sleep(stub.delay_s)
                states = []
                for row in payload["input"]:
                    with torch.no_grad():
                        h_TH = stub.model.model(input_ids=torch.tensor([row])).last_hidden_state[0].float()
                    states.append(h_TH if stub.transform is None else stub.transform(h_TH))
                dtype = getattr(torch, payload["embed_dtype"])
                raws = [h.to(dtype).contiguous().view(torch.uint8).numpy().tobytes() for h in states]
                if payload["encoding_format"] == "bytes":  # vLLM's layout: raw body, a metadata header
                    items, start = [], 0
                    for i, (raw, h) in enumerate(zip(raws, states)):
                        items.append(
                            dict(
                                index=i,
                                embed_dtype=payload["embed_dtype"],
                                start=start,
                                end=start + len(raw),
                                shape=list(h.shape),
                                endianness="little",
                            )
                        )
                        start += len(raw)
                    body = b"".join(raws)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.send_header("metadata", json.dumps({"data": items}))
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if payload["encoding_format"] == "base64":
                    data = [base64.b64encode(raw).decode() for raw in raws]
                else:
                    data = [h.tolist() for h in states]
                self._send(
                    200, {"data": [{"index": i, "object": "pooling", "data": d} for i, d in enumerate(data)]}
                )

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def prompt_logprobs(model, row: list[int], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a row: None for its first token, then for each token t the top-`k`
    log-probabilities of the state at t-1 by id (`logprob`, 1-based `rank`), and token t's own where it is
    not among them."""
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(input_ids=torch.tensor([row])).logits[0].float(), -1)
    out: list[dict | None] = [None]
    for t in range(1, len(row)):
        lp_V = logp_TV[t - 1]
        top = lp_V.topk(k)
        entry = {
            str(int(i)): {"logprob": float(v), "rank": r + 1}
            for r, (v, i) in enumerate(zip(top.values, top.indices))
        }
        if str(row[t]) not in entry:
            entry[str(row[t])] = {
                "logprob": float(lp_V[row[t]]),
                "rank": int((lp_V > lp_V[row[t]]).sum()) + 1,
            }
        out.append(entry)
    return out


@pytest.fixture(scope="module")
def teacher():
    return AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:student")


@pytest.fixture
def stub(teacher, tok):
    with StubPoolingServer(teacher, tokenizer=tok) as s:
        yield s


def _client(url: str, **kw) -> served.PoolingClient:
    return served.PoolingClient(url, **{"timeout_s": 5.0, "retries": 2, "backoff_s": 0.05, **kw})


def test_decoding_gives_the_models_states_in_both_encodings(stub, teacher):
    rows = [[3, 4, 5, 6], [7, 8]]
    with torch.no_grad():
        want = [teacher.model(input_ids=torch.tensor([r])).last_hidden_state[0] for r in rows]
    for encoding in ("bytes", "base64", "float"):
        for dtype in ("float32", "bfloat16"):
            got = _client(stub.url, encoding=encoding, dtype=dtype).hidden_states(rows)
            assert [tuple(g.shape) for g in got] == [(4, 128), (2, 128)]
            for g, w in zip(got, want):
                if encoding == "float":  # JSON numbers of the float32 states, whatever dtype was asked
                    torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
                else:
                    assert g.dtype == getattr(torch, dtype) and torch.equal(g, w.to(g.dtype))
    assert len(stub.pooling_requests) == 6  # one request per call, all rows in it


def test_decoding_refuses_pooled_or_misshapen_answers():
    h = base64.b64encode(np.zeros(5, dtype=np.float32).tobytes()).decode()
    body = json.dumps({"data": [{"index": 0, "data": h}]}).encode()
    with pytest.raises(served.TeacherServerError, match="tok_pooling_type"):
        served.decode_pooling(body, [2])
    with pytest.raises(served.TeacherServerError, match="answered 1 rows to a request of 2"):
        served.decode_pooling(body, [5, 1])


def test_a_failing_server_is_retried_then_one_error_names_the_url(stub):
    client = _client(stub.url)
    stub.fail_next = 2  # two 503s, then an answer: within the 1 + 2 tries
    assert len(client.hidden_states([[1, 2, 3]])) == 1
    assert client.stats.retries == 2
    stub.fail_next = 3
    with pytest.raises(served.TeacherServerError) as err:
        client.hidden_states([[1, 2, 3]])
    assert stub.url in str(err.value) and "after 3 tries" in str(err.value) and "resume" in str(err.value)
    stub.fail_next, stub.fail_status = 1, 400  # a bad request is not retried
    with pytest.raises(served.TeacherServerError, match="refused POST /pooling \\(400\\): stub failure"):
        client.hidden_states([[1, 2, 3]])


def test_the_api_key_in_the_environment_goes_with_every_request(stub, monkeypatch):
    monkeypatch.delenv(served.API_KEY_ENV, raising=False)
    _client(stub.url).models()
    assert stub.authorizations[-1] == ""
    monkeypatch.setenv(served.API_KEY_ENV, "sekrit")
    _client(stub.url).models()
    assert stub.authorizations[-1] == "Bearer sekrit"


def test_a_slow_or_absent_server_times_out_into_the_same_error(stub):
    stub.delay_s = 1.0
    client = _client(stub.url, timeout_s=0.2, retries=1)
    t0 = time.monotonic()
    with pytest.raises(served.TeacherServerError, match="after 2 tries.*timed out"):
        client.hidden_states([[1, 2]])
    assert time.monotonic() - t0 < 1.5
    stub.delay_s = 0.0
    from opdkit.run.server import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(served.TeacherServerError, match=f"{dead} did not answer.*Connection"):
        _client(dead).hidden_states([[1, 2]])


def test_state_gap_is_zero_for_final_norm_outputs_and_large_otherwise(teacher):
    head = load_head("tiny:teacher")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        out = teacher.model(input_ids=ids, output_hidden_states=True)
    post_TH, pre_TH = out.last_hidden_state[0], out.hidden_states[-2][0]
    assert served.state_gap(post_TH, head.norm_weight_H) < 1e-5
    assert served.state_gap(pre_TH, head.norm_weight_H) > 0.1
    normalised_TH = post_TH / post_TH.norm(dim=-1, keepdim=True)
    assert served.state_gap(normalised_TH, head.norm_weight_H) > 0.5
    student_norm_H = load_head("tiny:student").norm_weight_H
    assert student_norm_H.shape != head.norm_weight_H.shape or served.state_gap(post_TH, student_norm_H) > 0.1


def test_check_reports_the_server_and_refuses_mismatches(stub, tok):
    teacher = served.ServedTeacher(_client(stub.url), load_head("tiny:teacher"), served_dtype="float32")
    report = teacher.check(tokenizer=tok, expect_name="some/folder/tiny-teacher", min_model_len=200)
    assert report.served_name == "tiny-teacher" and report.hidden_size == 128 and report.tokenizer_checked
    assert report.state_gap < 1e-5 and len(report.probe_logprobs) == len(report.probe_ids) - 1
    assert all(lp < 0 for lp in report.probe_logprobs)
    with pytest.raises(served.ServedTeacherMismatch, match="not the teacher 'Qwen/Qwen3-4B'"):
        teacher.check(tokenizer=tok, expect_name="Qwen/Qwen3-4B")
    with pytest.raises(served.ServedTeacherMismatch, match="--max-model-len 4096"):
        teacher.check(tokenizer=tok, min_model_len=4096)
    with pytest.raises(served.ServedTeacherMismatch, match="does not take this vocabulary"):
        teacher.check(probe_ids=[1, 2, 500])
    stub.transform = lambda h: h * 1.5  # not the output of this checkpoint's final norm
    with pytest.raises(served.ServedTeacherMismatch, match="final norm"):
        teacher.check(tokenizer=tok)


def test_a_server_whose_tokenizer_splits_otherwise_is_refused(teacher, tok, qwen3_tokenizer):
    with StubPoolingServer(teacher, tokenizer=qwen3_tokenizer) as stub:
        st = served.ServedTeacher(_client(stub.url), load_head("tiny:teacher"), served_dtype="float32")
        with pytest.raises(served.ServedTeacherMismatch, match="token ids would mean different things"):
            st.check(tokenizer=tok)


def test_a_resume_against_another_served_model_is_refused(stub, tok):
    teacher = served.ServedTeacher(_client(stub.url), load_head("tiny:teacher"), served_dtype="float32")
    saved = teacher.check(tokenizer=tok).as_dict()
    served.check_same_teacher(saved, teacher.check(tokenizer=tok), "float32")
    stub.model = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    with torch.no_grad():
        stub.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # layers differ, final norm the same
    later = teacher.check(tokenizer=tok)
    assert later.state_gap < 1e-5  # the state check cannot see it ...
    with pytest.raises(served.ServedTeacherMismatch, match="other log-probabilities"):
        served.check_same_teacher(saved, later, "float32")  # ... the fingerprint does


def _trainer(tmp_path, teacher_model, tok) -> DistillTrainer:
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    args = _args(tmp_path)
    return DistillTrainer(model=student, args=args, processing_class=tok, teacher_model=teacher_model)


def _args(tmp_path) -> OPDArguments:
    return OPDArguments(
        output_dir=str(tmp_path),
        report_to=[],
        rollout_max_new_tokens=task.MAX_COMPLETION_TOKENS,
        beta=1.0,
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        remove_unused_columns=False,
        max_steps=1,
        per_device_train_batch_size=4,
    )


def _rollout(tok, n: int = 6) -> sampling.Rollout:
    from opdkit.data.prompts import PromptCollator

    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"))
    batch = PromptCollator(tok, 64)(
        [{"messages": [{"role": "user", "content": p.prompt}]} for p in task.problems(n, 21)]
    )
    torch.manual_seed(2)
    return sampling.sample(
        student,
        batch["prompts"],
        batch["prompt_attention_mask"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )


def assert_relatively_close(got: dict, want: dict, rel: float) -> None:
    """Each tensor within `rel` of the reference in norm: the served teacher's rows run unpadded, one by one,
    so single elements differ from the padded batch's by rounding (1e-7 absolute), not the update."""
    for n, w in want.items():
        err = float((got[n] - w).norm() / w.norm().clamp(min=1e-30))
        assert err < rel, f"{n}: relative difference {err:.3g}"


def loss_and_grads(
    trainer: DistillTrainer, r: sampling.Rollout, prepare: bool = False
) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradient of one micro-batch through the trainer's `compute_loss`; `prepare`: the teacher
    gets the rows first (`Teacher.prepare`), as the trainer does once per step."""
    batch = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
    if prepare:
        trainer.teacher.prepare([(batch["record"], batch["teacher_inputs"])], step=0)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("prepared", [False, True], ids=["per-micro-batch", "prepare_step"])
def test_the_trainer_with_a_served_teacher_computes_the_in_process_loss_and_gradient(
    tmp_path, stub, teacher, tok, prepared
):
    r = _rollout(tok)
    want_loss, want_grads = loss_and_grads(_trainer(tmp_path / "local", teacher, tok), r)
    st = served.ServedTeacher(
        _client(stub.url), load_head("tiny:teacher"), served_dtype="float32", max_request_tokens=150
    )
    got_loss, got_grads = loss_and_grads(_trainer(tmp_path / "served", st, tok), r, prepare=prepared)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert_relatively_close(got_grads, want_grads, 1e-5)
    # 6 rows of ~40-60 tokens: cut into requests of at most 150 tokens; the first two checked
    sizes = [len(p["input"]) for p in stub.pooling_requests]
    assert (
        sum(sizes) == 6
        and len(sizes) > 1
        and all(
            sum(len(row) for row in p["input"]) <= 150 for p in stub.pooling_requests if len(p["input"]) > 1
        )
    )
    assert len(st.state_gaps) == 2 and max(st.state_gaps) < 1e-5
    assert not st._cache  # every prepared row was used


def test_a_micro_batch_waits_only_for_the_requests_holding_its_rows(stub, tok):
    """A prepared step's requests go one at a time here (`in_flight` 1, a slow server): the first
    micro-batch's states come back while the later requests are still on their way."""
    r = _rollout(tok, 6)
    rows = [reads(source.record_of(r.rows(torch.arange(i, i + 2)), [tok.eos_token_id])) for i in (0, 2, 4)]
    st = served.ServedTeacher(
        _client(stub.url), load_head("tiny:teacher"), "float32", max_request_tokens=1, in_flight=1
    )
    stub.delay_s = 0.2
    st.prepare_step(rows)  # one request per row: 6 requests
    first = st.states(rows[0]["input_ids"], rows[0]["attention_mask"])
    assert len(st._pending) == 4 and first.abs().sum() > 0
    for b in rows[1:]:
        st.states(b["input_ids"], b["attention_mask"])
    assert not st._pending and not st._cache and st.stats.requests == 6


def test_rows_with_padding_inside_are_refused(stub):
    st = served.ServedTeacher(_client(stub.url), load_head("tiny:teacher"), served_dtype="float32")
    ids = torch.tensor([[0, 5, 6, 7]])
    with pytest.raises(ValueError, match="not one run"):
        st.states(ids, torch.tensor([[1, 0, 1, 1]]))
    h = st.states(ids, torch.tensor([[0, 1, 1, 1]]))
    assert h[0, 0].abs().sum() == 0 and h[0, 1:].abs().sum() > 0 and math.isfinite(float(h.sum()))


def test_a_local_server_serves_the_teachers_states_on_its_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    server = served.local_server("Qwen/Qwen3-4B", tmp_path / "teacher.log", gpus=[6, 7], max_model_len=8192)
    flags = dict(zip(server.command[3::2], server.command[4::2]))
    assert flags["--runner"] == "pooling" and flags["--tensor-parallel-size"] == "2"
    assert flags["--served-model-name"] == "Qwen/Qwen3-4B" and flags["--max-model-len"] == "8192"
    assert server.env["CUDA_VISIBLE_DEVICES"] == "6,7" and "--enforce-eager" not in server.command
    assert server.url.startswith("http://127.0.0.1:") and not server.running
    assert "VLLM_API_KEY" not in server.env or server.env["VLLM_API_KEY"] == os.environ.get("VLLM_API_KEY")
    keyed = served.local_server("Qwen/Qwen3-4B", tmp_path / "teacher.log", gpus=[6], api_key="k3y-x")
    assert keyed.env["VLLM_API_KEY"] == "k3y-x" and "k3y-x" not in " ".join(keyed.command)  # its log shows it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        served.local_server("tiny:teacher", tmp_path / "t.log")
    cpu = served.local_server("tiny:teacher", tmp_path / "t.log", kv_cache_bytes=2**28)
    assert "--enforce-eager" in cpu.command and cpu.command[cpu.command.index("--model") + 1] == tiny.resolve(
        "tiny:teacher"
    )


def _training(tmp_path, teacher_model, tok, steps: int) -> DistillTrainer:
    from datasets import Dataset

    from opdkit.data.prompts import PromptCollator

    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer} for p in task.problems(8, 5)
    ]
    args = OPDArguments(
        output_dir=str(tmp_path),
        report_to=[],
        rollout_max_new_tokens=task.MAX_COMPLETION_TOKENS,
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        remove_unused_columns=False,
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        disable_tqdm=True,
    )
    return DistillTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")),
        args=args,
        processing_class=tok,
        teacher_model=teacher_model,
        train_dataset=Dataset.from_list(rows),
        data_collator=PromptCollator(tok, 64),
    )


def test_a_wrong_head_is_stopped_by_the_teacher_logprob_gap_on_the_first_step(tmp_path, stub, teacher, tok):
    """`teacher_logprob_gap` against the teacher in process (`reference`): the right head gives ~0 on the
    first steps; a head scaled by 1.5 (which the final-norm state check cannot see: the states are right)
    stops the run at step 1, before its update, with one line."""
    import dataclasses

    head = load_head("tiny:teacher")
    right = served.ServedTeacher(_client(stub.url), head, served_dtype="float32", reference=teacher)
    ok = _training(tmp_path / "right", right, tok, steps=3)
    ok.train()
    gaps = [h.get("teacher_logprob_gap") for h in ok.state.log_history if "loss" in h]
    assert gaps[0] < 1e-5 and gaps[1] < 1e-5 and gaps[2] is None, gaps  # checked on the first 2 steps
    scaled = dataclasses.replace(head, weight_VH=head.weight_VH * 1.5)
    wrong = served.ServedTeacher(_client(stub.url), scaled, served_dtype="float32", reference=teacher)
    bad = _training(tmp_path / "wrong", wrong, tok, steps=3)
    before = {n: p.detach().clone() for n, p in bad.model.named_parameters()}
    with pytest.raises(
        served.ServedTeacherMismatch, match=r"teacher_logprob_gap \S+ at step 1 \(tolerance 0.001"
    ):
        bad.train()
    assert bad.state.global_step == 0 and max(wrong.state_gaps) < 1e-5  # the state check passed
    assert all(torch.equal(p, before[n]) for n, p in bad.model.named_parameters())


@pytest.mark.parametrize("prepared", [False, True], ids=["per-micro-batch", "prepare_step"])
def test_a_served_teacher_with_another_tokenizer_gives_the_in_process_cross_tokenizer_loss(
    tmp_path, tok, prepared
):
    """tiny:teacher-bpe served by the stub: the rows sent are the teacher's own tokens (the student's prompt
    and completion re-tokenized), and the cross-tokenizer loss and gradient are the in-process teacher's."""
    bpe_tok = load_tokenizer("tiny:teacher-bpe")
    bpe = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher-bpe")).eval()
    r = _rollout(tok)

    def run(teacher, folder: str) -> tuple[float, dict[str, torch.Tensor], dict]:
        trainer = DistillTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")),
            args=_args(tmp_path / folder),
            processing_class=tok,
            teacher_model=teacher,
            teacher_tokenizer=bpe_tok,
        )
        assert trainer.teacher.tokenizer is bpe_tok
        batch = trainer.micro_batch(source.record_of(r, trainer.stop_ids))
        if prepared and teacher is not bpe:
            trainer.teacher.prepare([(batch["record"], batch["teacher_inputs"])], step=0)
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        return float(loss.detach()), grads, batch["teacher_inputs"]

    want_loss, want_grads, batch = run(bpe, "local")
    with StubPoolingServer(bpe, tokenizer=bpe_tok) as stub:
        st = served.ServedTeacher(
            _client(stub.url), load_head("tiny:teacher-bpe"), served_dtype="float32", max_request_tokens=150
        )
        assert st.check(tokenizer=bpe_tok).tokenizer_checked
        got_loss, got_grads, _ = run(st, "served")
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    assert_relatively_close(got_grads, want_grads, 1e-5)
    sent = [row for p in stub.pooling_requests[1:] for row in p["input"]]  # after the check's probe
    ids, attn = batch["teacher_input_ids"], batch["teacher_attention_mask"].bool()
    # the teacher's tokens, unpadded (requests in flight together may arrive in either order)
    assert sorted(sent) == sorted(ids[b][attn[b]].tolist() for b in range(ids.shape[0]))
    assert not st._cache


def test_prepare_step_keeps_each_rows_states_where_it_predicts_a_loss_token():
    """Counted from the row's first real token; a multi-turn row's marks come in runs (the tools' tokens
    between them are context, their states dropped)."""
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    pred = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0]]).bool()
    got = served_teacher._marked(pred, attn)
    assert [g.tolist() for g in got] == [[1, 2], [1, 2, 5], []]


def test_the_client_sends_the_key_from_the_environment_and_a_wrong_one_is_one_line(stub, monkeypatch):
    """`OPDKIT_TEACHER_API_KEY`: `Authorization: Bearer <key>` on every request; a server that refuses the
    key (401) is one `TeacherServerError` line naming the variable, without retries; https URLs are taken."""
    stub.api_key = "sk-right"
    try:
        monkeypatch.delenv(served.API_KEY_ENV, raising=False)
        with pytest.raises(
            served.TeacherServerError, match=r"refused the request \(401.*OPDKIT_TEACHER_API_KEY"
        ):
            served.ServerClient(stub.url, retries=3, backoff_s=10.0).models()  # no backoff: no retry
        monkeypatch.setenv(served.API_KEY_ENV, "sk-wrong")
        with pytest.raises(served.TeacherServerError, match="which is not this one") as e:
            served.ServerClient(stub.url, retries=0).models()
        assert "sk-wrong" not in str(e.value) and "\n" not in str(e.value)
        monkeypatch.setenv(served.API_KEY_ENV, "sk-right")
        stub.authorizations.clear()
        assert served.ServerClient(stub.url).models()[0]["id"] == stub.name
        assert stub.authorizations == ["Bearer sk-right"]
    finally:
        stub.api_key = ""
    assert served.ServerClient("https://teacher.example:8443/").url == "https://teacher.example:8443"
