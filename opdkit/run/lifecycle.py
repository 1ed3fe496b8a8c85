"""One run lifecycle for every job: a job is a recipe (`Job`) that says how to prepare, what each process
holds (its memory plan), what each process runs and how the run is summed up; `run_job` does the rest, the
same way for all of them.

    JOB = Job("whitebox", WhiteboxConfig, prepare=prepare, stages=stages, process=process)
    run = run_job(JOB, "tiny", {"max_steps": 50})        # a RunDir; None after a dry run

`run_job`, in order: the config (`mode`'s preset and `overrides`, checked), `prepare` (everything that can
fail cheaply: data, tokenizers, model configs; nothing written), the memory plan (`fit` first sets what the
plan decides, e.g. `trace_batch_size: 0`), shown; under `dry_run` it stops there (`PlanOnly` in a notebook
kernel, None elsewhere), and a plan that does not fit stops before any weight is loaded; then what lives
around the run (`around`, e.g. whitebox's local teacher server) is entered, and left however the run ends;
inside it the run folder (config.yaml, plan.json; each process writes env.json; on rank 0 only under
torchrun, where every process must be told the same `run_dir`), the processes (`num_processes`, 0: one per
visible GPU; under torchrun each process is already one of them), each running `process`; the summary
(`summarize`, written by rank 0) and the tracker (`track`). A run that fails says so in its summary
(`status: failed: ...`) before the error goes on up.

Pitfalls this module exists for:
- nothing may touch CUDA in the parent before `launch` forks its processes, so everything here before the
  launch reads configs only;
- a forked process prepares its own copy (cheap): tokenizers and datasets do not survive a fork well; a run in
  this process reuses the caller's `prepared`;
- a job that spreads its own work over processes (`own_processes`, antidistill) cannot also run under
  torchrun.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opdkit import memory
from opdkit.config import ConfigError, RunFailure, RunFields, load_config, one_line
from opdkit.run import tracking
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir, print0, rank
from opdkit.run.launch import RankFailed, default_num_processes, launch, under_external_launcher


def in_kernel() -> bool:
    """True inside an IPython kernel (JupyterLab, papermill, nbclient). A kernel has imported IPython already;
    elsewhere it is not imported here (half a second of a dry run)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and "IPKernelApp" in shell.config


class PlanOnly(Exception):
    """A `dry_run` in a notebook kernel: stops Run All (and papermill) after the memory plan, so the report
    cells below the run cell never meet a run that did not happen. Shown as one line, not a traceback."""

    def _render_traceback_(self) -> list[str]:  # IPython shows this instead of the traceback
        return [f"{type(self).__name__}: {self}"]


def stop_after_plan(job: str) -> None:
    """Where a run stops under `dry_run`: raises PlanOnly in a notebook kernel, returns elsewhere (`run_job`
    then returns None, as a script or the CLI expects)."""
    if in_kernel():
        raise PlanOnly(
            f"dry run: {job} stopped after the memory plan above; nothing was loaded or written. "
            "Set dry_run to False (or leave it out) to run it."
        )


@dataclass(frozen=True)
class Job:
    """A job's recipe. `prepare(cfg, mode)` returns the prepared run (anything with `cfg`, and `first_example`
    to show before the plan, if it has one); the other hooks take it.

    - `stages(prep, budget)`: what one process holds in each stage, one after the other (`memory.Stage`);
    - `process(prep, run, *extra, **kwargs)`: what every process runs;
    - `summarize(prep, run, failure)`: the summary (None: the processes wrote it); `failure` is a dead rank's
      report when `keeps_going`;
    - `fit(prep, budget)`: the prepared run with the settings the plan decides (`fit_trace_batch`);
    - `processes(prep, run)`: (how many processes, extra arguments of `process`); default: `num_processes`;
      0: nothing left to run (a resumed run that had finished);
    - `track(prep, run, summary)`: the summary to the `report_to` tracker;
    - `around(prep)`: a context manager for what lives around the run (a server it starts), entered after the
      plan (never under `dry_run`) and left however the run ends; it yields the prepared run the run uses
      (e.g. pointed at the server it started).
    """

    name: str
    config: type[RunFields]
    prepare: Callable[[Any, str], Any]
    stages: Callable[[Any, float | None], dict[str, memory.Stage]]
    process: Callable[..., None]
    summarize: Callable[[Any, RunDir, str | None], dict | None] | None = None
    fit: Callable[[Any, float | None], Any] | None = None
    processes: Callable[[Any, RunDir], tuple[int, tuple]] | None = None
    track: Callable[[Any, RunDir, dict], None] | None = None
    around: Callable[[Any], AbstractContextManager[Any]] | None = None
    own_processes: bool = False  # spreads its work over processes itself: refuses torchrun
    keeps_going: bool = False  # a process that dies ends the launch, and the summary is still gathered


def prepare_job(job: Job, mode: str = "tiny", overrides: dict | None = None) -> Any:
    """`mode`'s preset with `overrides`, checked, then the job's `prepare`: every cheap failure, nothing
    written."""
    cfg = load_config(job.config, mode, overrides)
    tracking.check_report_to(cfg.report_to)
    return job.prepare(cfg, mode)


def plan_job(job: Job, prep: Any) -> tuple[Any, memory.JobPlan | None]:
    """The prepared run (with what `fit` set) and its memory plan per process, against `plan_gpu_memory_gb` or
    the visible GPU's memory (None: the job loads nothing itself, e.g. a lesson over given runs)."""
    budget = memory.budget_gb(prep.cfg.plan_gpu_memory_gb)
    if job.fit is not None:
        prep = job.fit(prep, budget)
    stages = job.stages(prep, budget)
    return prep, memory.plan_job(stages, budget, memory.card_gb()) if stages else None


def fit_trace_batch(prep: Any, budget: float | None, stages: dict[str, memory.Stage]) -> Any:
    """`trace_batch_size: 0` made the largest batch with which every one of `stages` fits `budget` (the
    prepared run returned with it set); any other value as it is."""
    cfg = prep.cfg
    if cfg.trace_batch_size != 0:
        return prep
    if budget is None or any(s.rollout_engine == "vllm" for s in stages.values()):
        raise ConfigError(
            "trace_batch_size=0 means the largest batch that fits the memory plan, which needs the kit's "
            "loop (rollout_engine=hf) and a budget: a GPU, or plan_gpu_memory_gb; or give a batch size."
        )
    largest = min(memory.largest_batch(stage, budget) for stage in stages.values())
    if not largest:
        raise ConfigError(
            f"not even one sequence of {cfg.max_prompt_length} + {cfg.trace_max_new_tokens} tokens fits "
            f"{budget:.1f} "
            "GB beside the models; shorten trace_max_new_tokens or use a larger GPU."
        )
    print0(f"trace_batch_size 0: {largest}, the largest batch that fits the plan's {budget:.1f} GB")
    return dataclasses.replace(prep, cfg=dataclasses.replace(cfg, trace_batch_size=largest))


def run_job(
    job: Job,
    mode: str = "tiny",
    overrides: dict | None = None,
    prepared: Any = None,
    *,
    child: bool = False,
    **kwargs: Any,
) -> RunDir | None:
    """Run `job` (see the module's docstring): returns its run folder, or None after a dry run. `prepared`: a
    notebook's own `prepare_job` result (its first example already shown); `child`: a run inside another
    (`run_child`), whose plan is checked and saved but not shown again; `kwargs` go to every `process` (in
    this process only: transformers callbacks, say)."""
    prep = prepared if prepared is not None else prepare_job(job, mode, overrides)
    if prepared is None and not child and getattr(prep, "first_example", ""):
        print0(prep.first_example)
    prep, plan = plan_job(job, prep)
    cfg = prep.cfg
    if plan is not None and not child:
        print0(plan.table())
    if cfg.dry_run:
        stop_after_plan(job.name)
        return None
    if plan is not None:
        plan.check()
    if job.own_processes and under_external_launcher():
        raise ConfigError(
            f"{job.name} spreads its work over processes itself: start it as one process with "
            "num_processes=N (0: every visible GPU), not under torchrun or accelerate launch."
        )
    with job.around(prep) if job.around else contextlib.nullcontext(prep) as prep:
        return run_prepared(job, prep, plan, kwargs)


def run_prepared(job: Job, prep: Any, plan: memory.JobPlan | None, kwargs: dict) -> RunDir:
    """The run of a planned `prep`: its folder, its processes, its summary and the tracker."""
    cfg = prep.cfg
    run = create_run(cfg, job.name, prep.mode)
    if run.writer and plan is not None:
        atomic_write_text(run.path / memory.PLAN_FILE, plan.to_json())
    n, extra = job.processes(prep, run) if job.processes else (default_num_processes(cfg.num_processes), ())
    local = n <= 1 or under_external_launcher()
    args = (job, dataclasses.asdict(cfg), prep.mode, str(run.path), prep if local else None, extra, kwargs)
    failure = None
    try:
        if n > 0:
            launch(run_process, args, n, run.path)
    except RankFailed as exc:
        if not job.keeps_going:
            known = failed(run, exc)
            if known is None:
                raise
            raise known from exc
        failure = str(exc)
    except BaseException as exc:
        known = failed(run, exc)
        if known is None:
            raise
        raise known from exc
    summary = job.summarize(prep, run, failure) if job.summarize else None
    if summary is not None:
        run.write_summary(summary)
    if job.track and run.writer:
        job.track(prep, run, summary if summary is not None else run.read_summary())
    return run


def run_child(
    run: Callable[..., RunDir | None],
    mode: str,
    overrides: dict,
    path: Path,
    resume: bool,
    label: str,
    **kwargs,
) -> RunDir:
    """A run inside another one (an arm of a lesson, one seed of repeats) in `path`, by the job's `run(mode,
    overrides, child=True, **kwargs)`: its plan is not shown again (the parent's plan holds it). With `resume`
    a finished child (done, or stopped on a non-finite gradient) is reused as it is and an unfinished one
    continues from its newest complete checkpoint."""
    over = {**overrides, "run_dir": str(path)}
    if resume and path.is_dir() and any(path.iterdir()):
        summary = path / "summary.json"
        status = RunDir.attach(path).read_summary().get("status", "") if summary.is_file() else ""
        if status == "done" or status.startswith("stopped"):
            print0(f"--- {label}: reusing the finished run in {path} ({status})")
            return RunDir.attach(path)
        over["resume"] = True
    return run(mode, over, child=True, **kwargs)


def run_process(
    job: Job, cfg_dict: dict, mode: str, run_path: str, prepared: Any, extra: tuple, kwargs: dict
) -> None:
    """What every process runs: its prepared run (the caller's, or its own from the resolved config, where
    what `fit` decided is already set), then the job's `process`."""
    prep = prepared if prepared is not None else job.prepare(job.config(**cfg_dict), mode)
    job.process(prep, RunDir.attach(run_path), *extra, **kwargs)


def create_run(cfg: RunFields, job: str, mode: str) -> RunDir:
    """The run folder: made here, or under torchrun / accelerate launch made by rank 0 and attached by the
    others (every process must then be told the same `run_dir`)."""
    if not under_external_launcher():
        return RunDir.create(cfg, job=job, mode=mode)
    if not cfg.run_dir:
        raise ConfigError(
            "under torchrun / accelerate launch every process must write to one folder: pass --set "
            "run_dir=PATH."
        )
    return RunDir.create(cfg, job=job, mode=mode) if rank() == 0 else RunDir.attach(cfg.run_dir)


ERROR_FILE = "error.txt"  # a failed run's traceback


class RunFailed(RunFailure, RuntimeError):
    """A run that failed in a way the kit knows (`failure_line`): one line, naming the file that keeps the
    traceback."""


def failed(run: RunDir, exc: BaseException) -> RunFailed | None:
    """`mark_failed`, then what to raise instead of `exc`: a failure the kit knows as `RunFailed`; None to
    raise `exc` itself (a bug keeps its traceback; a child run's `RunFailed` already names its file)."""
    mark_failed(run, exc)
    line = None if isinstance(exc, RunFailed) else failure_line(exc)
    return RunFailed(f"{line} (traceback: {run.path / ERROR_FILE})") if line else None


def failure_line(exc: BaseException) -> str | None:
    """What failed and what to do, in one line, for a failure the kit knows; None for any other."""
    text, name = one_line(exc), type(exc).__name__
    if isinstance(exc, RunFailure):
        return text
    if isinstance(exc, RankFailed):  # its message holds each dead rank's traceback
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        return f"{lines[0].rstrip(':')}: {lines[-1]}; each rank's traceback is in the run's errors/"
    if name == "OutOfMemoryError" or isinstance(exc, MemoryError):  # torch's (CUDA), or the host's
        return (
            f"the run ran out of memory ({text[:200]}), though its memory plan fit: lower "
            "per_device_train_batch_size, trace_batch_size, eval_batch_size, rollout_max_new_tokens or "
            "trace_max_new_tokens, or plan with less (plan_gpu_memory_gb); resume=true continues from the "
            "last checkpoint."
        )
    if name in ("SafetensorError", "UnpicklingError") or "PytorchStreamReader" in text:
        return (
            f"a weights or checkpoint file cannot be read ({text[:200]}): it is corrupt or cut short; "
            "replace it, or with resume move the newest checkpoint-N out of the run's checkpoints/ to resume "
            "from the one before."
        )
    if isinstance(exc, ValueError) and "chat template" in text:
        return (
            f"a tokenizer has no chat template ({text[:200]}): use a model whose tokenizer has one (an "
            "instruct or chat model), or give its tokenizer_config.json a chat_template."
        )
    return None


def mark_failed(run: RunDir, exc: BaseException) -> None:
    """Say in the summary that the run failed and why, and keep its traceback in error.txt (what it had
    written before is kept)."""
    if not run.writer:
        return
    atomic_write_text(run.path / ERROR_FILE, "".join(traceback.format_exception(exc)))
    summary = run.read_summary() if (run.path / "summary.json").is_file() else {}
    last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    run.write_summary({**summary, "status": f"failed: {type(exc).__name__}: {last}"[:500]})
