"""What the test files share, in one place: `from helpers import tiny_model` (conftest.py holds the fixtures;
no test file imports another). Grouped by what they serve: the tiny world's models and rollouts, whitebox runs
and the step's gradient from scratch, the references the losses are tested against (`generalized_jsd`, the
mean generalized JSD over full logits), tool episodes played by hand and scripted, the teacher interface's
calls and a stub pooling server, a tiny trainer, and the memory plan's hand counts."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from opdkit import tiny
from opdkit.data import prompts
from opdkit.data.prompts import PromptCollator
from opdkit.jobs import whitebox
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.cliplesson.config import ClipLessonConfig
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.models import load_tokenizer
from opdkit.opd.loss import DivergenceOutput, per_token_divergence
from opdkit.opd.teachers import served, topk
from opdkit.opd.teachers.base import DivergenceInputs, Teacher
from opdkit.rollout import engines, sampling, source
from opdkit.rollout.multiturn import MultiTurnRollouts
from opdkit.tasks import tiny as tiny_task
from opdkit.tasks import tinytools

if TYPE_CHECKING:  # the trainer and its arguments import transformers' Trainer (seconds): inside the helpers
    from opdkit.opd.arguments import OPDArguments
    from opdkit.opd.trainer import DistillTrainer

# The tiny world: its models, prompts and a rollout; every job's config class.
# Every job's config class, in notebook order (01 to 04): the tests that cover every job iterate it.
CONFIGS = {c.job: c for c in (SaveGradConfig, WhiteboxConfig, ClipLessonConfig, AntidistillConfig)}


def tiny_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A fresh copy of one of the tiny world's models (`tiny:teacher`, `tiny:student`), in eval mode."""
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name), dtype=dtype).eval()


def tiny_prompts(
    tok: PreTrainedTokenizerBase, n: int = 6, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (1- to 3-digit problems), so padding is exercised."""
    probs = [tiny_task.problems(1, seed + i, n_digits=1 + i % 3)[0] for i in range(n)]
    return sampling.encode_prompts(tok, [[{"role": "user", "content": p.prompt}] for p in probs])


def tiny_rollout(teacher: torch.nn.Module, tok: PreTrainedTokenizerBase, seed: int = 0) -> sampling.Rollout:
    """The teacher's plain samples for `tiny_prompts`."""
    ids, mask = tiny_prompts(tok)
    torch.manual_seed(seed)
    return sampling.sample(
        teacher,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=tiny_task.MAX_COMPLETION_TOKENS,
    )


# A run killed after a step (resume tests).
class Interrupted(Exception):
    pass


class InterruptAt:
    """A TrainerCallback that dies like a killed job after `step` optimizer steps."""

    def __init__(self, step):
        self.step = step

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            raise Interrupted(f"killed after step {self.step}")


# whitebox runs of the tiny world, and the step's gradient computed from scratch.
# Near-greedy sampling makes completions independent of how prompts are batched, so that runs with
# different batch shapes see the same completions.
FIXED = dict(
    max_steps=1,
    eval_size=0,
    sample_every=0,
    checkpoint_every=0,
    max_grad_norm=0.0,
    save_rollouts=True,
    rollout_temperature=0.001,
    subset_size=64,
)


def run_tiny(tmp_path: Path, name: str, callbacks=None, **overrides):
    over = {**FIXED, "run_dir": str(tmp_path / name), **overrides}
    return whitebox.run("tiny", over, callbacks=callbacks)


def first_step_logits(run_path: Path, student, teacher):
    """Each saved micro-batch of a run's first step (`save_rollouts`): the student's logits (with gradient),
    the teacher's (without) and the sampled token, at every position predicting a loss token."""
    for f in sorted((run_path / "rollouts").glob("step000001-rank*.pt")):
        for mb in torch.load(f):
            ids, attn, sampled_BT = mb["input_ids"], mb["attention_mask"], mb["loss_mask_BT"].bool()
            pos = sampling.position_ids_from_mask(attn)
            s_logits = student(input_ids=ids, attention_mask=attn, position_ids=pos).logits
            with torch.no_grad():
                t_logits = teacher(input_ids=ids, attention_mask=attn, position_ids=pos).logits
            sel = sampled_BT[:, 1:]  # the logits at t predict token t+1
            yield s_logits[:, :-1][sel], t_logits[:, :-1][sel], ids[:, 1:][sel]


def direct_gradient(
    run_path: Path, beta: float = 1.0, student: str = "tiny:student", teacher: str = "tiny:teacher"
) -> dict[str, torch.Tensor]:
    """The step's gradient computed from scratch: full logits, TRL's loss over all completion tokens (the
    tokens of loss mask 1: a multi-turn transcript's student turns)."""
    from trl.experimental.gkd import GKDTrainer

    student = AutoModelForCausalLM.from_pretrained(tiny.resolve(student))
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve(teacher))
    s_rows, t_rows = [], []
    for s_NV, t_NV, _ in first_step_logits(run_path, student, teacher):
        s_rows.append(s_NV)
        t_rows.append(t_NV)
    s, t = torch.cat(s_rows)[None], torch.cat(t_rows)[None]
    loss = GKDTrainer.generalized_jsd_loss(s, t, labels=torch.zeros(s.shape[:2], dtype=torch.long), beta=beta)
    loss.backward()
    return {n: p.grad for n, p in student.named_parameters()}


def assert_grads_close(a: dict, b: dict, rtol=2e-4):
    assert a.keys() == b.keys()
    for name in a:
        scale = b[name].abs().max().item() + 1e-12
        err = (a[name] - b[name]).abs().max().item() / scale
        assert err < rtol, f"{name}: relative error {err:.2e}"


# Episodes of at most 2 turns of the tiny tool world: the prompt (83 tokens with the tools), a call (~96), the
# tool's result with the template's tokens, an answer; 96 + 160 fit the tiny models' 256 positions.
TOOL_RUN = dict(
    dataset_path="tiny-tools",
    student_model="tiny:teacher-tools",
    teacher_model="tiny:teacher",
    environment="calculator",
    max_turns=2,
    max_prompt_length=96,
    rollout_max_new_tokens=100,
    episode_max_tokens=160,
    subset_size=16,
)


def episodes(run_path) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(the row's token ids, its loss mask) of each row of the first step, whichever process played it."""
    rows = []
    for f in sorted((run_path / "rollouts").glob("step000001-rank*.pt")):
        for mb in torch.load(f):
            for ids, attn, m in zip(mb["input_ids"], mb["attention_mask"], mb["loss_mask_BT"]):
                real = attn.bool()
                rows.append((tuple(ids[real].tolist()), tuple(m[real].tolist())))
    return rows


def tool_turns(mask: tuple[int, ...]) -> int:
    """Runs of context tokens between two of the student's turns."""
    s = "".join(map(str, mask)).strip("0")
    return len([gap for gap in s.split("1") if gap])


# References the library's losses are tested against.
def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Mean over masked tokens of the per-token generalized JSD; logits (..., V), mask (...).

    Gradient flows to whichever logits require it; a frozen teacher's simply do not.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must have the same shape; slice both to the tokenizer's "
            "vocabulary (logits[..., :len(tokenizer)]) if the models pad their heads differently"
        )
    vocab = student_logits.shape[-1]
    student_logits_NV = student_logits.reshape(-1, vocab)
    teacher_logits_NV = teacher_logits.reshape(-1, vocab)
    if mask is not None:
        if mask.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"mask {tuple(mask.shape)} must match the logits without their vocabulary dimension, "
                f"{tuple(student_logits.shape[:-1])}; pass the completion mask of the same batch"
            )
        mask_N = mask.reshape(-1).bool()
        # Selecting rows first skips the softmax work on padding.
        student_logits_NV = student_logits_NV[mask_N]
        teacher_logits_NV = teacher_logits_NV[mask_N]
    if student_logits_NV.shape[0] == 0:
        raise ValueError(
            "the mask selects no tokens, so the mean divergence is undefined; drop empty batches or "
            "check that the mask marks completion tokens with 1/True"
        )
    return per_token_divergence(student_logits_NV, teacher_logits_NV, beta, temperature).mean()


def sorted_l1_reference(a_RV: torch.Tensor, b_RW: torch.Tensor) -> torch.Tensor:
    """ULD's sorted L1 by a plain sort of both rows, the shorter padded with zeros."""
    width = max(a_RV.shape[1], b_RW.shape[1])
    sa = F.pad(a_RV.sort(-1, descending=True).values, (0, width - a_RV.shape[1]))
    sb = F.pad(b_RW.sort(-1, descending=True).values, (0, width - b_RW.shape[1]))
    return (sa - sb).abs().sum(-1)


# Completions for the cross-tokenizer tests (tests/test_opd_crosstok_*.py): emoji, CJK, multi-byte text.
CROSSTOK_TEXTS = [
    "Héllo 世界! 🤖👍🏽 naïve café — 東京タワー 123456 Ω≈ç√ ∫ x² 🇯🇵 done.",
    "Step 1: 12 + 30 = 42.\n答案是 42。 Ünïcödé ✓ 😀😀",
    "ok",
]
CROSSTOK_PROMPTS = ["Solve: 🤖 + 世界?", "Add twelve and thirty.", "Say ok."]


# The tiny tool world's greedy episodes, played and graded by hand (tests of `tasks.evaluate.episode_accuracy`
# and of whitebox's accuracy with an environment): each turn decoded one token at a time with a full forward,
# the call read with `json`, the sum done in Python, the answer graded by its text after ';'.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


def greedy_turn_by_hand(
    model, tok, conversation: list[dict], limit: int = tinytools.MAX_TURN_TOKENS
) -> str | None:
    """One greedy turn, token by token with the full forward each time; None when it hits the limit."""
    ids = tok.apply_chat_template(
        conversation, tools=tinytools.TOOLS, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(limit):
            nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                return tok.decode(out)
            out.append(nxt)
    return None


def tool_episode_by_hand(model, tok, problem_text: str, reference: str) -> tuple[bool, bool, bool]:
    """(answer right, called the calculator correctly, called at all) of one greedy two-turn episode."""
    conv = [{"role": "user", "content": problem_text}]
    first = greedy_turn_by_hand(model, tok, conv)
    if first is None:
        return False, False, False
    if TOOL_CALL_OPEN not in first:  # no call: the first turn is the answer
        return first.rpartition(";")[2].strip() == reference and ";" in first, False, False
    body = first.split(TOOL_CALL_OPEN, 1)[1].split(TOOL_CALL_CLOSE, 1)[0]
    call = json.loads(body)  # the teacher's calls are JSON (a failure here fails the test)
    assert call["name"] == "calculator" and set(call["arguments"]) == {"expression"}
    result = str(sum(int(t) for t in call["arguments"]["expression"].split("+")))
    conv += [{"role": "assistant", "content": first}, {"role": "tool", "content": result}]
    final = greedy_turn_by_hand(model, tok, conv)
    right = final is not None and ";" in final and final.rpartition(";")[2].strip() == reference
    return right, result == reference, True


# Multi-turn episodes with scripted turns (`rollout.multiturn`).
def settings(
    tok, max_new_tokens=tiny_task.MAX_COMPLETION_TOKENS, temperature=1.0
) -> engines.SamplingSettings:
    return engines.SamplingSettings(max_new_tokens, temperature, 1.0, [tok.eos_token_id], tok.pad_token_id)


def call(expression) -> str:
    body = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


class Scripted:
    """An engine whose rows write scripted turns: the script of a row is looked up by its prompt (the user
    turn's text), its turn by the assistant turns its context already holds. Records each call's batch
    size."""

    name = "scripted"

    def __init__(self, tok, scripts: dict[str, list[str]]):
        self.tok, self.scripts, self.calls = tok, scripts, []

    def sync(self, model):
        pass

    def close(self):
        pass

    def sample(self, model, ids_BP, mask_BP, s, seeds) -> sampling.Rollout:
        self.calls.append(ids_BP.shape[0])
        tokens = []
        for ids, mask in zip(ids_BP, mask_BP):
            text = self.tok.decode(ids[mask.bool()], skip_special_tokens=False)
            prompt = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
            turn = text.count("<|im_start|>assistant\n") - 1
            out = self.tok(self.scripts[prompt][turn], add_special_tokens=False)["input_ids"]
            tokens.append((out + [self.tok.eos_token_id])[: s.max_new_tokens])
        return sampling.assemble(ids_BP, mask_BP, tokens, None, s)


def play(tok, scripts, env, sizes, max_turns=4, episode_max_tokens=0, max_new_tokens=200):
    prompts = list(scripts)
    collate = PromptCollator(tok, 512, tools=env.tools)
    bs, at = [], 0
    for n in sizes:
        bs.append(
            collate(
                [{"messages": [{"role": "user", "content": p}], "answer": "x"} for p in prompts[at : at + n]]
            )
        )
        at += n
    engine = Scripted(tok, scripts)
    source = MultiTurnRollouts(
        lambda: engine,
        settings(tok, max_new_tokens),
        0,
        0,
        1,
        sizes[0],
        environment=env,
        tokenizer=tok,
        max_turns=max_turns,
        episode_max_tokens=episode_max_tokens,
    )
    return source.next_step(None, bs, 0), source, engine


# Teachers: every call of the interface, a top-K client without a server, a stub pooling server.
def args(tmp_path, **over) -> OPDArguments:
    from opdkit.opd.arguments import OPDArguments

    return OPDArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **over)


def answers_every_call(kind: Teacher, tok, tmp_path, teacher_ids=None) -> dict:
    """Every call of `Teacher` on the tiny world's rollout, in the trainer's order, each answer of the type
    the interface promises; the loss is finite and reaches the student's weights. Returns what it got."""
    student = tiny_model("tiny:student")
    a = args(tmp_path)
    kind.start(student, tok, a)
    kind.place(torch.device("cpu"), shard=False)
    record = source.record_of(tiny_rollout(tiny_model("tiny:teacher"), tok), [tok.eos_token_id])
    if teacher_ids:
        record = source.RolloutRecord(**{**record.__dict__, "teacher_ids": teacher_ids(record)})
    own = kind.inputs(record)
    kind.prepare([(record, own)], step=0)  # the first step (0-based)
    n = kind.loss_count(record, own)
    assert n.dim() == 0 and float(n) > 0
    pred_BT = record.predicting_BT()
    fwd = dict(
        input_ids=record.input_ids_BT,
        attention_mask=record.attention_mask_BT,
        position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
        use_cache=False,
    )
    part = kind.score(record, own, fwd, pred_BT)
    given = DivergenceInputs(beta=1.0, temperature=1.0, vocab_size=len(tok), chunk_size=16)
    parts = kind.student_divergence(student, fwd, pred_BT, part, given)
    out, sums = kind.output(parts, record, part)
    assert isinstance(out, DivergenceOutput) and out.per_token_N.shape == (int(pred_BT.sum()),)
    assert torch.isfinite(out.sum) and out.student_entropy_N.shape == out.per_token_N.shape
    (out.sum / n).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())
    zero = kind.new_sums("cpu")
    if zero is not None:
        assert sums is None or sums.shape == zero.shape
        metrics = kind.metrics((zero + (0 if sums is None else sums.to(zero))).tolist())
    else:
        metrics = kind.metrics(None)
    assert isinstance(metrics, dict)
    probe = tok("12+34=46", add_special_tokens=False)["input_ids"]
    fingerprint = kind.fingerprint(probe)
    if fingerprint is not None:
        kind.check_same(fingerprint, kind.fingerprint(probe))  # the same teacher passes
    assert isinstance(kind.name, str) and kind.name  # how the log and the errors call it
    described = kind.describe("tiny:teacher")
    assert described is None or isinstance(described, str)
    assert isinstance(kind.exact, bool) and isinstance(kind.module, torch.nn.Module)
    return {"out": out, "n": n, "metrics": metrics, "fingerprint": fingerprint, "sums": sums}


class LogitsClient:
    """What `PromptLogprobsClient.topk` returns, computed from a model's logits (no server)."""

    def __init__(self, model):
        self.model = model

    def topk(self, rows, k):
        out = []
        for row in rows:
            with torch.no_grad():
                logits_TV = self.model(input_ids=torch.tensor([row])).logits[0, :-1]
            out.append(topk.teacher_topk(logits_TV, k, torch.tensor(row[1:])))
        return out


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


def pooling_client(url: str, **kw) -> served.PoolingClient:
    return served.PoolingClient(url, **{"timeout_s": 5.0, "retries": 2, "backoff_s": 0.05, **kw})


# A tiny trainer and its rollouts: the kit's greedy loop, micro-batches, a vLLM engine's memory share.
def tiny_trainer(tmp_path, callbacks=(), prompts=24, **kw) -> DistillTrainer:
    """The tiny student distilled from the tiny teacher on `prompts` problems: 3 steps of 4 rows x 2
    accumulations, 10 new tokens a rollout (`kw`: any other `OPDArguments`)."""
    from opdkit.opd.arguments import OPDArguments
    from opdkit.opd.trainer import DistillTrainer

    tok = load_tokenizer("tiny:student")
    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer}
        for p in tiny_task.problems(prompts, 1)
    ]
    settings = dict(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        rollout_max_new_tokens=10,
        disable_tqdm=True,
        remove_unused_columns=False,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        data_seed=0,
    )
    return DistillTrainer(
        model=tiny_model("tiny:student"),
        args=OPDArguments(**{**settings, **kw}),
        train_dataset=Dataset.from_list(rows),
        data_collator=PromptCollator(tok, 64),
        processing_class=tok,
        teacher_model=tiny_model("tiny:teacher"),
        callbacks=list(callbacks),
    )


def train_logs(trainer: DistillTrainer) -> list[dict]:
    """The per-step log records (loss and the step's metrics)."""
    try:
        trainer.train()
    finally:
        trainer.close_engine()
    return [h for h in trainer.state.log_history if "loss" in h]


def hf_greedy(model, tok, ids, mask, max_new_tokens=12) -> sampling.Rollout:
    """The kit's loop, greedy, called directly (not through an engine)."""
    return sampling.sample(
        model,
        ids,
        mask,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )


def micro_batches(tok, sizes=(3, 1, 2)):
    collate = prompts.PromptCollator(tok, 64)
    problems = ["7+5", "358+467", "12+1", "999+999", "1+1", "40+2"]
    out, i = [], 0
    for n in sizes:
        out.append(collate([{"messages": [{"role": "user", "content": p}]} for p in problems[i : i + n]]))
        i += n
    return out


MEMORY = 0.04  # on CPU a share of RAM; the tiny models need a few hundred MB


# The memory plan's hand counts: Qwen3's published configs, their parameters, 02 full's rollout producer.
# The published config.json of each model (Qwen/Qwen3-*), the fields that shape it.
_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}
QWEN3 = {
    "Qwen3-0.6B": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "tie_word_embeddings": True,
    },
    "Qwen3-1.7B": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "tie_word_embeddings": True,
    },
    "Qwen3-4B": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "tie_word_embeddings": True,
    },
    "Qwen3-8B": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "tie_word_embeddings": False,
    },
}
# By hand: embedding + layers x (q + k + v + o + gate/up/down + two RMSNorms + q_norm/k_norm) + final norm
# (+ the untied head of 8B). q is heads x 128 wide, k and v 8 x 128 = 1024.
HAND_PARAMS = {
    "Qwen3-0.6B": 151936 * 1024
    + 28 * (1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128)
    + 1024,
    "Qwen3-1.7B": 151936 * 2048
    + 28 * (2048 * 2048 + 2 * 2048 * 1024 + 2048 * 2048 + 3 * 2048 * 6144 + 2 * 2048 + 2 * 128)
    + 2048,
    "Qwen3-4B": 151936 * 2560
    + 36 * (2560 * 4096 + 2 * 2560 * 1024 + 4096 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128)
    + 2560,
    "Qwen3-8B": 2 * 151936 * 4096
    + 36 * (4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128)
    + 4096,
}
SMALL = {
    "model_type": "qwen3",
    "hidden_size": 96,
    "intermediate_size": 200,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 3,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}
VOCAB, HIDDEN = 151936, 1024  # Qwen3-0.6B
P, C, ROWS = 1024, 1024, 64  # 02 full: prompt and completion tokens, a step's rows on one process
PARAMS = HAND_PARAMS["Qwen3-0.6B"]
KV_FP32 = 2 * 28 * 8 * 128 * 4  # K and V per token, both fp32: the producer decodes without autocast
QUEUE = "the rollout producer's queue in host memory"
OWN_GPU = "the rollout producer on a GPU of its own"


def producer_by_hand() -> dict[str, int]:
    """The producer's rows of 02 full on one process, by hand: its fp32 copy; the state_dict sent to it (the
    tied embedding under both names) on the device at once; its fp32 KV cache; the prefill's one layer for
    every prompt token (residual x 3, q x 2, k/v x 2, MLP x 3, 4 B), one layer's cache being extended and
    three fp32 rows of logits per row."""
    prefill = ROWS * P * 4 * (3 * 1024 + 2 * 2048 + 2 * 1024 + 3 * 3072)
    kv = ROWS * (P + C) * KV_FP32
    return {
        "rollout producer weights": PARAMS * 4,
        "rollout producer weight update": (PARAMS + VOCAB * HIDDEN) * 4,
        "KV cache, rollout producer": kv,
        "decoding working set, rollout producer": prefill + kv // 28 + 3 * ROWS * VOCAB * 4,
    }


# A small antidistill sweep (conftest's `small_run`).
# A small antidistill sweep: ADS (λ 0.2), answer-gradient ADS (λ 0.1) and two temperatures, two runs each.
SMALL_SWEEP = {
    "subset_size": 24,
    "eval_size": 16,
    "sft_max_steps": 3,
    "sft_batch_size": 8,
    "sft_micro_batch_size": 3,
    "lams": [0.0, 0.2],
    "answer_lams": [0.1],
    "temperatures": [1.5],
    "repeats": 2,
}
