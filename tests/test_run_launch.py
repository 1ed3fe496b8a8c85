"""Launching job functions in forked processes (accelerate's notebook launcher, gloo on CPU)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_forked_ranks_can_convert_weights_in_threads(tmp_path):
    """transformers loads weights by converting dtypes in a thread pool; in a process forked from one
    that had set torch's thread count, the first such calls race to rebuild torch's thread pool and one
    can fail ("Invalid thread pool!"), about one forked process in two without `launch`'s rebuild."""
    script = textwrap.dedent(f"""
        from concurrent.futures import ThreadPoolExecutor
        import torch
        from opdkit.run.launch import launch

        def convert_in_threads():
            xs = [torch.randn(300, 300) for _ in range(16)]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda x: x.to(torch.bfloat16), xs))

        torch.set_num_threads(1)
        torch.ones(100_000).to(torch.bfloat16)
        for i in range(4):  # 8 forked processes in all
            launch(convert_in_threads, (), 2, {str(tmp_path)!r} + f"/run{{i}}")
        print("all ranks converted")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "all ranks converted" in proc.stdout, proc.stderr[-3000:]


def test_small_models_run_on_one_thread_unless_omp_is_set_and_the_caller_gets_its_count_back(
    tmp_path, monkeypatch
):
    """A JupyterLab kernel has no OMP_NUM_THREADS: tiny models get one torch thread for the job only."""
    import torch

    from opdkit.models import load_model
    from opdkit.run.launch import launch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        seen = []
        launch(lambda: seen.append((load_model("tiny:student"), torch.get_num_threads())[1]), (), 1, tmp_path)
        assert seen == [1] and torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        launch(lambda: seen.append((load_model("tiny:student"), torch.get_num_threads())[1]), (), 1, tmp_path)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_a_cpu_launch_says_it_runs_on_the_cpu(tmp_path):
    """accelerate's notebook launcher announces "Launching training on 2 CUDAs." on a machine without GPUs;
    the kit's launch says what it runs on instead, and nothing else accelerate prints is lost."""
    script = textwrap.dedent(f"""
        from opdkit.run.launch import launch

        def hello():
            print("rank ran", flush=True)

        launch(hello, (), 2, {str(tmp_path / "run")!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "launching 2 processes on the CPU (gloo)" in proc.stdout
    assert "CUDA" not in proc.stdout + proc.stderr
    assert proc.stdout.count("rank ran") == 2


def test_a_rank_that_fails_in_a_known_way_says_one_line_and_keeps_its_traceback(tmp_path, monkeypatch, capfd):
    """A launched rank's failure the kit knows (`RunFailure`) is one line on stderr, a bug its traceback; both
    tracebacks are kept in errors/rank<N>.txt."""
    from opdkit.config import RunFailure
    from opdkit.run import launch

    class ServerGone(RunFailure, RuntimeError):
        pass

    monkeypatch.setattr(launch, "_rebuild_thread_pool_after_fork", lambda: None)
    monkeypatch.setenv("RANK", "1")
    for exc, rank_line in [
        (ServerGone("the teacher's server\nstopped"), "error: the teacher's server stopped"),
        (ZeroDivisionError("a bug"), "Traceback (most recent call last):"),
    ]:

        def fail(exc=exc):
            raise exc

        with pytest.raises(type(exc)):
            launch._Traced(fail, tmp_path / "errors")()
        err = capfd.readouterr().err.splitlines()
        assert err[:2] == ["[rank 1] failed:", rank_line]
        assert (
            (tmp_path / "errors" / "rank1.txt").read_text().startswith("Traceback (most recent call last):")
        )
        assert type(exc).__name__ in (tmp_path / "errors" / "rank1.txt").read_text()
