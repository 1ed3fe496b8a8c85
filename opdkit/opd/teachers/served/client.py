"""The teacher server's HTTP client: JSON over `httpx`, a timeout on every request and a bounded number of
retries with exponential backoff, then one `TeacherServerError` naming the URL; the key of a server started
with `--api-key` (`API_KEY_ENV`) on every request, and a refusal (401/403) said in one line; a vLLM pooling
server's final hidden states (`PoolingClient`), decoded from bytes, base64 or JSON numbers.

A server down, slow or gone mid-run: the error is raised inside the step, before its optimizer update, so the
run's checkpoints are the last saved ones, intact for `resume`.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from opdkit.config import RunFailure

# Statuses that may pass if asked again (the server is starting, overloaded or restarting).
RETRYABLE = {408, 429, 500, 502, 503, 504}
# The key a server started with `--api-key` wants (sent as `Authorization: Bearer <key>`); unset: none sent.
API_KEY_ENV = "OPDKIT_TEACHER_API_KEY"


class TeacherServerError(RunFailure, RuntimeError):
    """The teacher's server cannot be reached, or answered wrongly; the message names its URL (`last`: the
    last failure of a server that did not answer)."""

    last = ""


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
    """JSON over HTTP to one server (`httpx`), each call with a timeout (`timeout_s`, per connection and per
    read) and up to `retries` more tries after a connection error, a timeout or a retryable status, waiting
    `backoff_s`, 2x, 4x, ... between them; then one `TeacherServerError` naming the URL. With `API_KEY_ENV`
    set, every request carries its key (`Authorization: Bearer`), as vLLM's `--api-key` asks."""

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
        headers = {"Content-Type": "application/json"}
        if os.environ.get(API_KEY_ENV):
            headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
        # One client for the threads of a prepared step (httpx's clients are thread-safe).
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, follow_redirects=True)

    def get(self, path: str) -> Any:
        return json.loads(self.call("GET", path))

    def post(self, path: str, payload: dict) -> Any:
        return json.loads(self.call("POST", path, payload))

    def call(self, method: str, path: str, payload: dict | None = None) -> bytes:
        """The response body of `method path`, tried up to 1 + `retries` times."""
        return self.exchange(method, path, payload)[0]

    def exchange(self, method: str, path: str, payload: dict | None = None) -> tuple[bytes, dict[str, str]]:
        """(response body, response headers, names in lower case) of `method path`, tried up to 1 + `retries`
        times."""
        data = None if payload is None else json.dumps(payload).encode()
        waited, last = 0.0, ""
        for attempt in range(self.retries + 1):
            if attempt:
                pause = self.backoff_s * 2 ** (attempt - 1)
                time.sleep(pause)
                waited += pause
                with self.lock:
                    self.stats.retries += 1
            try:
                r = self._http.request(method, self.url + path, content=data)
            except httpx.TransportError as e:  # no connection, a timeout, a broken answer
                last = f"{type(e).__name__}: {e}"
                continue
            if r.is_success:
                return r.content, dict(r.headers.items())
            detail = _error_detail(r)
            if r.status_code in (401, 403):
                raise TeacherServerError(
                    f"the teacher server at {self.url} refused the request ({r.status_code}: {detail}): set "
                    f"{API_KEY_ENV} to the key it was started with (vLLM's --api-key)"
                    + (", which is not this one." if "Authorization" in self._http.headers else ".")
                )
            if r.status_code not in RETRYABLE:
                raise TeacherServerError(
                    f"the teacher server at {self.url} refused {method} {path} ({r.status_code}): {detail}"
                )
            last = f"HTTP {r.status_code}: {detail}"
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


def _error_detail(r: httpx.Response) -> str:
    try:
        body = json.loads(r.content)
        return str(body.get("error", {}).get("message") or body.get("message") or body)[:500]
    except (ValueError, AttributeError):
        return r.reason_phrase


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
