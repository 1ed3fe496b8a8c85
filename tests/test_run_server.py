"""A server this run starts and stops: ready when its health URL answers, stopped with its whole process
group however the block ends, a start that fails says why with the end of its log; the vLLM command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from opdkit.run import server as srv


def _http_server(port: int) -> list[str]:
    """A tiny server that forks a child (as vLLM's API server forks its engine core) and answers GET /."""
    code = (
        "import os, http.server, sys, time\n"
        "if os.fork() == 0:\n    time.sleep(600)\n    sys.exit(0)\n"
        f"http.server.ThreadingHTTPServer(('127.0.0.1', {port}), http.server.SimpleHTTPRequestHandler)"
        ".serve_forever()\n"
    )
    return [sys.executable, "-c", code]


def _live_members(pgid: int) -> list[int]:
    """Processes of the group that still run (zombies, waiting for whoever reaps orphans, do not)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def test_a_server_is_up_inside_the_block_and_its_whole_group_is_gone_after(tmp_path):
    port = srv.free_port()
    url = f"http://127.0.0.1:{port}"
    proc = srv.ServerProcess(_http_server(port), url, tmp_path / "s.log", health_path="/", grace_s=5)
    with pytest.raises(RuntimeError, match="boom"), proc:
        assert srv.is_up(url, "/") and proc.running and proc.start_s is not None
        pgid = proc.process.pid
        raise RuntimeError("boom")  # a failing run stops its server too
    assert not srv.is_up(url, "/") and not proc.running
    assert _live_members(pgid) == []  # the forked child went with it
    assert "$ " in (tmp_path / "s.log").read_text()  # the command heads its log


def test_a_server_that_dies_while_starting_fails_at_once_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no such model: xyz'); sys.exit(3)"]
    proc = srv.ServerProcess(
        cmd, f"http://127.0.0.1:{srv.free_port()}", tmp_path / "s.log", start_timeout_s=60
    )
    with pytest.raises(srv.ServerStartError, match="exited with code 3(.|\n)*no such model: xyz"):
        proc.start()


def test_a_server_that_is_never_ready_is_stopped_after_the_timeout(tmp_path):
    cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
    proc = srv.ServerProcess(
        cmd, f"http://127.0.0.1:{srv.free_port()}", tmp_path / "s.log", start_timeout_s=1
    )
    with pytest.raises(srv.ServerStartError, match="not ready after 1 s"):
        proc.start()
    assert not proc.running


def test_the_vllm_command_serves_final_hidden_states_or_logprobs():
    cmd = srv.vllm_command("Qwen/Qwen3-4B", 8000, tensor_parallel=2, max_model_len=4096, dtype="bfloat16")
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--runner"] == "pooling" and flags["--tensor-parallel-size"] == "2"
    assert json.loads(flags["--pooler-config"]) == {
        "task": "token_embed",
        "tok_pooling_type": "ALL",
        "use_activation": False,
    }
    gen = srv.vllm_command("m", 1, runner="generate", max_logprobs=64)
    assert "--pooler-config" not in gen and gen[gen.index("--max-logprobs") + 1] == "64"
    assert srv.gpu_env([2, 3])["CUDA_VISIBLE_DEVICES"] == "2,3"
