"""Run a job function in 1 or N processes, from a notebook or a script.

    launch(train_fn, (cfg_dict, run_path), num_processes=2)      # a job's runs go through run.lifecycle

N > 1 goes through accelerate's `notebook_launcher` (fork; gloo on CPU, NCCL on GPUs). Nothing may
touch CUDA or create an Accelerator in the parent before it forks. The launch says what it runs on
(`launch_message`: "launching 2 processes on the CPU (gloo)"), in place of accelerate's line, which names
CUDA on a machine without GPUs. A rank that fails writes its real
traceback to `<run_dir>/errors/rank<k>.txt` and stderr before re-raising; the parent then raises one
error carrying that traceback, so a notebook (and papermill's exit status) shows what went wrong.
Past one node, run `python -m opdkit.whitebox` under torchrun / `accelerate launch` instead: each
process then calls the job function directly (`num_processes` is ignored there).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from opdkit.config import ConfigError, RunFailure, one_line


def default_num_processes(requested: int) -> int:
    """0 means every visible GPU, or 1 on a CPU; under torchrun the launcher already decided."""
    if requested > 0:
        return requested
    import torch

    return max(1, torch.cuda.device_count())


def under_external_launcher() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_processes(num_processes: int) -> int:
    """The processes a run will have: the launcher's under torchrun / accelerate launch, else `num_processes`
    (0: every visible GPU, 1 on a CPU)."""
    return launched_world_size() if under_external_launcher() else default_num_processes(num_processes)


def launched_world_size() -> int:
    """Processes of this run, as the launcher (notebook_launcher, torchrun, accelerate) announced them."""
    return int(os.environ.get("WORLD_SIZE", "1"))


class RankFailed(RuntimeError):
    pass


class _Traced:
    """Picklable wrapper that records a rank's traceback before re-raising."""

    def __init__(self, fn: Callable, error_dir: Path):
        self.fn, self.error_dir = fn, error_dir
        functools.update_wrapper(self, fn)  # launchers name the entry point after fn.__name__

    def __call__(self, *args):
        try:
            _rebuild_thread_pool_after_fork()
            return self.fn(*args)
        except BaseException:
            rank = os.environ.get("RANK", "0")
            text = traceback.format_exc()
            self.error_dir.mkdir(parents=True, exist_ok=True)
            (self.error_dir / f"rank{rank}.txt").write_text(text)
            exc = sys.exc_info()[1]
            shown = f"error: {one_line(exc)}" if isinstance(exc, (RunFailure, ConfigError)) else text
            print(f"[rank {rank}] failed:\n{shown}", file=sys.__stderr__, flush=True)  # a known one: one line
            raise


def _rebuild_thread_pool_after_fork() -> None:
    """In a forked process, let torch rebuild its intra-op thread pool once, on this thread.

    After a fork torch drops the parent's pool and the next `set_num_threads` call rebuilds it; when
    several threads make that first call at once, as transformers' weight loader does when it converts
    dtypes in a thread pool, one of them can see no pool ("Invalid thread pool!"), about one forked
    process in two here. One call here, before any other thread exists, settles it.
    """
    import torch

    torch.set_num_threads(torch.get_num_threads())


def launch(fn: Callable, args: tuple, num_processes: int, run_path: str | Path) -> None:
    """Call `fn(*args)` in `num_processes` processes (in this one when 1 or under torchrun)."""
    if num_processes <= 1 or under_external_launcher():
        import torch

        threads = torch.get_num_threads()  # jobs may lower it for small models: give the caller's back
        try:
            fn(*args)
        finally:
            torch.set_num_threads(threads)
        return
    from accelerate import notebook_launcher
    from accelerate.state import AcceleratorState

    # An earlier run in this process (a Trainer, one process) leaves accelerate's state behind, and the
    # launcher refuses to start while it exists; the launched processes build their own.
    AcceleratorState._reset_state(reset_partial_state=True)
    error_dir = Path(run_path) / "errors"
    print(launch_message(num_processes), flush=True)
    try:
        with _without_accelerate_launch_line():
            notebook_launcher(
                _Traced(fn, error_dir), args, num_processes=num_processes, use_port=str(_free_port())
            )
    except BaseException as exc:
        reports = sorted(error_dir.glob("rank*.txt")) if error_dir.exists() else []
        detail = (
            "\n".join(f"--- {p.stem} ---\n{p.read_text()}" for p in reports) or f"{type(exc).__name__}: {exc}"
        )
        raise RankFailed(
            f"{len(reports) or 'a'} rank(s) failed in {num_processes}-process run:\n{detail}"
        ) from exc


def launch_message(num_processes: int) -> str:
    """What a launch of `num_processes` processes runs on: the visible GPUs (NCCL) or the CPU (gloo). The
    GPU count is NVML's, which leaves CUDA untouched before the fork."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus:
        return f"launching {num_processes} processes on {min(gpus, num_processes)} of {gpus} GPU(s) (nccl)"
    return f"launching {num_processes} processes on the CPU (gloo)"


@contextlib.contextmanager
def _without_accelerate_launch_line():
    """accelerate's `notebook_launcher` announces "Launching training on N CUDAs." whatever the device (its
    device guess defaults to CUDA): its module's `print` drops that line meanwhile (`launch_message` says
    it instead); anything else it prints goes through."""
    from accelerate import launchers

    def quiet(*args, **kwargs):
        if not (args and str(args[0]).startswith("Launching training on")):
            print(*args, **kwargs)

    launchers.print = quiet  # a module global shadows the builtin for that module's code only
    try:
        yield
    finally:
        del launchers.print


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
