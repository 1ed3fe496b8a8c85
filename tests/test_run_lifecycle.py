"""opdkit.run.lifecycle on a toy job: the dry run, the plan's verdict before any folder, the run folder and
its plan, the one in-process launch, the summary and the tracker, a failing process, a run with nothing left
to run, the refusal of torchrun for a job that spreads itself, and `trace_batch_size: 0` fitted to the
plan."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from opdkit import memory
from opdkit.config import ConfigError, RunFields, load_config
from opdkit.memory import ModelShape, Stage
from opdkit.run import lifecycle
from opdkit.run.folders import RunDir
from opdkit.run.launch import RankFailed

TEACHER = ModelShape.from_config("tiny:teacher")


@dataclass
class ToyConfig(RunFields):
    job = "toy"  # a plain class attribute, as RunFields.job: not a field

    trace_batch_size: int = 4
    max_prompt_length: int = 8
    trace_max_new_tokens: int = 8


@dataclass(frozen=True)
class ToyPrep:
    cfg: ToyConfig
    mode: str = "tiny"
    first_example: str = ""


def toy_stages(prep: ToyPrep, budget: float | None) -> dict[str, Stage]:
    cfg = prep.cfg
    return {
        "decode": Stage(
            bf16=True,
            teacher=TEACHER,
            sampler="teacher",
            sampled_rows=cfg.trace_batch_size,
            prompt_len=cfg.max_prompt_length,
            completion_len=cfg.trace_max_new_tokens,
        )
    }


class Calls:
    """What the toy job's hooks were called with, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def named(self, name: str) -> list[Any]:
        return [args for n, args in self.log if n == name]


def toy_job(calls: Calls, **hooks: Any) -> lifecycle.Job:
    """A job whose hooks record their calls; `hooks` replaces any of them (or sets `fit`, `processes`...)."""

    def prepare(cfg: ToyConfig, mode: str) -> ToyPrep:
        calls.log.append(("prepare", (cfg, mode)))
        return ToyPrep(cfg, mode, first_example="first example: 1+1")

    def process(prep: ToyPrep, run: RunDir, *extra: Any, **kwargs: Any) -> None:
        calls.log.append(("process", (os.getpid(), prep, run.path, extra, kwargs)))

    def summarize(prep: ToyPrep, run: RunDir, failure: str | None) -> dict | None:
        calls.log.append(("summarize", (prep, run.path, failure)))
        return {"answer": 42, "failure": failure}

    def track(prep: ToyPrep, run: RunDir, summary: dict) -> None:
        calls.log.append(("track", (prep, run.path, summary)))

    base = dict(prepare=prepare, stages=toy_stages, process=process, summarize=summarize, track=track)
    return lifecycle.Job("toy", ToyConfig, **{**base, **hooks})


def toy_prep(tmp_path: Path, **cfg: Any) -> ToyPrep:
    values = {"run_dir": str(tmp_path / "run"), "num_processes": 1, "plan_gpu_memory_gb": 3.0, **cfg}
    return ToyPrep(ToyConfig(**values), first_example="first example: 1+1")


@pytest.fixture(autouse=True)
def _not_under_a_launcher(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


# ---- the dry run and the plan's verdict ----------------------------------------------------------------


def test_a_dry_run_shows_the_plan_returns_none_and_writes_nothing(tmp_path, capsys):
    calls = Calls()
    prep = toy_prep(tmp_path, dry_run=True)
    assert lifecycle.run_job(toy_job(calls), prepared=prep) is None
    assert not (tmp_path / "run").exists()
    assert calls.named("process") == [] and calls.named("summarize") == [] and calls.named("track") == []
    out = capsys.readouterr().out
    assert "memory plan per process" in out and "first example" not in out  # a notebook showed it already


def test_a_dry_run_in_a_kernel_stops_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(lifecycle, "in_kernel", lambda: True)
    calls = Calls()
    with pytest.raises(lifecycle.PlanOnly, match="dry run: toy stopped after the memory plan") as err:
        lifecycle.run_job(toy_job(calls), prepared=toy_prep(tmp_path, dry_run=True))
    assert err.value._render_traceback_() == [f"PlanOnly: {err.value}"]
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists() and calls.named("process") == []


def test_outside_a_kernel_the_dry_run_stop_returns():
    assert not lifecycle.in_kernel()  # pytest runs no IPython kernel
    assert lifecycle.stop_after_plan("toy") is None


def test_a_plan_that_does_not_fit_stops_before_any_run_folder(tmp_path):
    calls = Calls()
    prep = toy_prep(tmp_path, plan_gpu_memory_gb=1e-4)  # 100 kB: not even the teacher's weights
    with pytest.raises(ConfigError, match="does not fit its memory budget"):
        lifecycle.run_job(toy_job(calls), prepared=prep)
    assert not (tmp_path / "run").exists() and calls.named("process") == []


def test_plan_job_plans_every_stage_against_the_configured_budget(tmp_path):
    prep = toy_prep(tmp_path, plan_gpu_memory_gb=0.5)
    same, plan = lifecycle.plan_job(toy_job(Calls()), prep)
    assert same is prep and list(plan.plans) == ["decode"]
    assert plan.plan.budget_bytes == 0.5 * memory.GB
    assert plan.plan.total == memory.plan(toy_stages(prep, 0.5)["decode"], 0.5).total
    _, none = lifecycle.plan_job(toy_job(Calls(), stages=lambda prep, budget: {}), prep)
    assert none is None


def test_plan_job_gives_vllm_its_share_of_the_visible_card(tmp_path, monkeypatch):
    """issue 28: vLLM reserves its share of the card's whole memory, not of a smaller budget."""
    prep = toy_prep(tmp_path, plan_gpu_memory_gb=80)

    def stages(prep, budget):
        return {"decode": dataclasses.replace(toy_stages(prep, budget)["decode"], rollout_engine="vllm")}

    monkeypatch.setattr(memory.device, "visible_gpu_memory_gb", lambda: 141.0)
    _, on_card = lifecycle.plan_job(toy_job(Calls(), stages=stages), prep)
    assert on_card.plan.row("rollout engine (vllm)").bytes == int(0.3 * 141e9)
    assert on_card.plan.row("reserve").bytes == 4e9  # 5 % of the 80 GB budget
    monkeypatch.setattr(memory.device, "visible_gpu_memory_gb", lambda: None)
    _, no_card = lifecycle.plan_job(toy_job(Calls(), stages=stages), prep)
    assert no_card.plan.row("rollout engine (vllm)").bytes == int(0.3 * 80e9)


# ---- a run ------------------------------------------------------------------------------------------


def test_a_run_writes_its_folder_runs_the_process_here_once_then_summarizes_and_tracks(tmp_path):
    calls = Calls()
    prep = toy_prep(tmp_path, seed=7)
    run = lifecycle.run_job(toy_job(calls), prepared=prep, callbacks=["cb"])
    assert run.path == tmp_path / "run" and run.writer
    config = yaml.safe_load((run.path / "config.yaml").read_text())
    assert (config["job"], config["mode"], config["seed"]) == ("toy", "tiny", 7)
    assert config["trace_batch_size"] == 4
    expected = memory.plan_job(toy_stages(prep, 3.0), 3.0).to_dict()
    assert json.loads((run.path / memory.PLAN_FILE).read_text()) == json.loads(json.dumps(expected))
    [(pid, got, path, extra, kwargs)] = calls.named("process")
    assert pid == os.getpid() and got is prep and path == run.path  # this process, the caller's prepared run
    assert extra == () and kwargs == {"callbacks": ["cb"]}
    assert calls.named("prepare") == []  # `prepared` was given: nothing prepared again
    assert run.read_summary() == {"answer": 42, "failure": None}
    [(_, track_path, summary)] = calls.named("track")
    assert track_path == run.path and summary == {"answer": 42, "failure": None}
    assert [n for n, _ in calls.log] == ["process", "summarize", "track"]


def test_a_job_without_stages_writes_no_plan(tmp_path):
    run = lifecycle.run_job(toy_job(Calls(), stages=lambda prep, budget: {}), prepared=toy_prep(tmp_path))
    assert (run.path / "config.yaml").is_file() and not (run.path / memory.PLAN_FILE).exists()


def test_a_summary_the_processes_wrote_is_the_one_tracked(tmp_path):
    calls = Calls()

    def process(prep, run, *extra, **kwargs):
        run.write_summary({"steps": 3})

    job = toy_job(calls, process=process, summarize=None)
    run = lifecycle.run_job(job, prepared=toy_prep(tmp_path))
    assert run.read_summary() == {"steps": 3}
    assert [s for _, _, s in calls.named("track")] == [{"steps": 3}]


def test_a_failing_process_marks_the_summary_and_the_error_goes_on_up(tmp_path):
    calls = Calls()

    def process(prep, run, *extra, **kwargs):
        run.write_summary({"steps": 3})
        raise RuntimeError("while stepping\nloss is nan at step 4")

    with pytest.raises(RuntimeError, match="loss is nan"):
        lifecycle.run_job(toy_job(calls, process=process), prepared=toy_prep(tmp_path))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == {"steps": 3, "status": "failed: RuntimeError: loss is nan at step 4"}
    assert calls.named("summarize") == [] and calls.named("track") == []


def around_hook(calls: Calls):
    """A job's `around` that records its entry and exit and hands the run a prepared run of its own (as a
    server it started would: another seed stands for the server's URL)."""

    @contextlib.contextmanager
    def around(prep: ToyPrep):
        calls.log.append(("enter", prep))
        inside = dataclasses.replace(prep, cfg=dataclasses.replace(prep.cfg, seed=prep.cfg.seed + 100))
        try:
            yield inside
        finally:
            calls.log.append(("exit", inside))

    return around


def test_what_lives_around_a_run_is_entered_before_its_folder_and_left_after_its_summary(tmp_path):
    calls = Calls()
    prep = toy_prep(tmp_path, seed=7)
    run = lifecycle.run_job(toy_job(calls, around=around_hook(calls)), prepared=prep)
    assert [n for n, _ in calls.log] == ["enter", "process", "summarize", "track", "exit"]
    [(_, inside, _, _, _)] = calls.named("process")
    assert calls.named("enter") == [prep] and inside.cfg.seed == 107  # the run uses what `around` yielded
    assert yaml.safe_load((run.path / "config.yaml").read_text())["seed"] == 107


def test_what_lives_around_a_run_is_left_when_the_run_fails(tmp_path):
    calls = Calls()

    def process(prep, run, *extra, **kwargs):
        calls.log.append(("process", prep))
        raise RuntimeError("the run failed")

    job = toy_job(calls, process=process, around=around_hook(calls))
    with pytest.raises(RuntimeError, match="the run failed"):
        lifecycle.run_job(job, prepared=toy_prep(tmp_path))
    assert [n for n, _ in calls.log] == ["enter", "process", "exit"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"].startswith("failed")


def test_nothing_is_entered_around_a_dry_run(tmp_path):
    calls = Calls()
    assert (
        lifecycle.run_job(
            toy_job(calls, around=around_hook(calls)), prepared=toy_prep(tmp_path, dry_run=True)
        )
        is None
    )
    assert calls.log == []


@pytest.mark.parametrize("keeps_going", [False, True])
def test_a_dead_rank_ends_the_run_unless_the_job_keeps_going(tmp_path, keeps_going):
    calls = Calls()

    def process(prep, run, *extra, **kwargs):
        raise RankFailed("1 rank(s) failed in 2-process run:\n--- rank1 ---\nout of memory")

    job = toy_job(calls, process=process, keeps_going=keeps_going)
    if not keeps_going:
        with pytest.raises(
            lifecycle.RunFailed, match=r"^1 rank\(s\) failed in 2-process run: out of memory;"
        ) as e:
            lifecycle.run_job(job, prepared=toy_prep(tmp_path))
        assert isinstance(e.value.__cause__, RankFailed)
        assert json.loads((tmp_path / "run" / "summary.json").read_text()) == {
            "status": "failed: RankFailed: out of memory"
        }
        return
    run = lifecycle.run_job(job, prepared=toy_prep(tmp_path))
    [(_, _, failure)] = calls.named("summarize")
    assert "out of memory" in failure and run.read_summary()["failure"] == failure


def test_processes_decide_the_count_and_the_extra_arguments(tmp_path):
    calls = Calls()
    job = toy_job(calls, processes=lambda prep, run: (1, ("points", 3)))
    lifecycle.run_job(job, prepared=toy_prep(tmp_path))
    [(_, _, _, extra, _)] = calls.named("process")
    assert extra == ("points", 3)


def test_nothing_left_to_run_still_summarizes(tmp_path):
    calls = Calls()
    run = lifecycle.run_job(toy_job(calls, processes=lambda prep, run: (0, ())), prepared=toy_prep(tmp_path))
    assert calls.named("process") == []
    assert len(calls.named("summarize")) == 1 and run.read_summary()["answer"] == 42


def test_a_job_that_spreads_itself_refuses_an_external_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    calls = Calls()
    with pytest.raises(ConfigError, match="not under torchrun"):
        lifecycle.run_job(toy_job(calls, own_processes=True), prepared=toy_prep(tmp_path))
    assert not (tmp_path / "run").exists() and calls.named("process") == []


def test_a_forked_process_prepares_its_own_copy_from_the_resolved_config(tmp_path):
    """What a process launched by `launch` runs when it was handed no prepared run."""
    calls = Calls()
    job = toy_job(calls)
    cfg = toy_prep(tmp_path, trace_batch_size=9).cfg
    (tmp_path / "run").mkdir()
    lifecycle.run_process(job, dataclasses.asdict(cfg), "sanity", str(tmp_path / "run"), None, ("x",), {})
    [(made, mode)] = calls.named("prepare")
    assert made == cfg and made is not cfg and mode == "sanity"
    [(_, prep, path, extra, _)] = calls.named("process")
    assert prep.cfg is made and path == tmp_path / "run" and extra == ("x",)


# ---- preparing from a preset ---------------------------------------------------------------------------


@pytest.fixture
def toy_presets(tmp_path, monkeypatch) -> Path:
    """params/toy/tiny.yaml in a temporary folder, which `prepare_job` reads."""
    params = tmp_path / "params"
    (params / "toy").mkdir(parents=True)
    (params / "toy" / "tiny.yaml").write_text("trace_batch_size: 6\ntrace_max_new_tokens: 12\n")
    monkeypatch.setattr(lifecycle, "load_config", functools.partial(load_config, params_dir=params))
    return params


def test_prepare_job_reads_the_preset_and_the_overrides(tmp_path, toy_presets):
    calls = Calls()
    prep = lifecycle.prepare_job(toy_job(calls), "tiny", {"trace_max_new_tokens": 20, "seed": 3})
    assert (prep.cfg.trace_batch_size, prep.cfg.trace_max_new_tokens, prep.cfg.seed) == (6, 20, 3)
    assert prep.mode == "tiny" and calls.named("prepare") == [(prep.cfg, "tiny")]
    with pytest.raises(
        ConfigError, match="unknown setting 'trace_max_new_token' for toy; did you mean trace_max_new_tokens"
    ):
        lifecycle.prepare_job(toy_job(calls), "tiny", {"trace_max_new_token": 20})


def test_a_run_that_prepares_itself_shows_its_first_example(tmp_path, toy_presets, capsys):
    calls = Calls()
    run = lifecycle.run_job(
        toy_job(calls),
        "tiny",
        {"run_dir": str(tmp_path / "run"), "num_processes": 1, "plan_gpu_memory_gb": 3.0},
    )
    assert "first example: 1+1" in capsys.readouterr().out
    assert yaml.safe_load((run.path / "config.yaml").read_text())["trace_batch_size"] == 6


# ---- the run folder under a launcher, and a failure's mark ---------------------------------------------


def test_create_run_under_an_external_launcher_needs_one_folder_for_every_process(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="run_dir"):
        lifecycle.create_run(ToyConfig(), "toy", "tiny")
    monkeypatch.setenv("RANK", "1")
    other = lifecycle.create_run(ToyConfig(run_dir=str(tmp_path / "run")), "toy", "tiny")
    assert not other.writer and not (tmp_path / "run").exists()  # attached: rank 0 makes it
    monkeypatch.setenv("RANK", "0")
    first = lifecycle.create_run(ToyConfig(run_dir=str(tmp_path / "run")), "toy", "tiny")
    assert first.writer and (tmp_path / "run" / "config.yaml").is_file()


def test_mark_failed_keeps_what_was_written_and_says_why_in_one_line(tmp_path):
    run = RunDir(tmp_path)
    lifecycle.mark_failed(run, ValueError(""))
    assert run.read_summary() == {"status": "failed: ValueError: "}
    run.write_summary({"steps": 2})
    lifecycle.mark_failed(run, KeyboardInterrupt("x" * 1000))
    summary = run.read_summary()
    assert summary["steps"] == 2 and summary["status"].startswith("failed: KeyboardInterrupt: xxx")
    assert len(summary["status"]) == 500
    lifecycle.mark_failed(RunDir(tmp_path, writer=False), RuntimeError("not rank 0"))
    assert run.read_summary() == summary


# ---- trace_batch_size 0: the largest batch the plan allows -----------------------------------------------


def test_trace_batch_size_zero_needs_a_budget(tmp_path):
    prep = toy_prep(tmp_path, trace_batch_size=0)
    with pytest.raises(ConfigError, match="needs the kit's loop"):
        lifecycle.fit_trace_batch(prep, None, toy_stages(prep, None))
    vllm = {"decode": dataclasses.replace(toy_stages(prep, 1.0)["decode"], rollout_engine="vllm")}
    with pytest.raises(ConfigError, match="rollout_engine=hf"):
        lifecycle.fit_trace_batch(prep, 1.0, vllm)


def test_trace_batch_size_zero_becomes_the_largest_batch_that_fits(tmp_path):
    prep = toy_prep(tmp_path, trace_batch_size=0)
    budget = 2.05  # 0.05 GB beside the 2 GB reserve
    stages = toy_stages(prep, budget)
    longer = {**stages, "long": dataclasses.replace(stages["decode"], completion_len=64)}
    fitted = lifecycle.fit_trace_batch(prep, budget, longer)
    largest = min(memory.largest_batch(s, budget) for s in longer.values())
    assert fitted.cfg.trace_batch_size == largest
    assert 1 < largest < memory.largest_batch(stages["decode"], budget)  # the longer stage decides
    assert prep.cfg.trace_batch_size == 0  # the caller's prepared run is left alone
    assert not memory.plan(dataclasses.replace(longer["long"], sampled_rows=largest + 1), budget).fits
    with pytest.raises(ConfigError, match="not even one sequence"):
        lifecycle.fit_trace_batch(prep, 1e-4, stages)


def test_a_batch_size_that_was_given_is_left_alone(tmp_path):
    prep = toy_prep(tmp_path, trace_batch_size=3)
    assert lifecycle.fit_trace_batch(prep, None, toy_stages(prep, None)) is prep


def test_a_run_plans_and_runs_with_what_fit_decided(tmp_path):
    calls = Calls()

    def fit(prep, budget):
        return lifecycle.fit_trace_batch(prep, budget, toy_stages(prep, budget))

    run = lifecycle.run_job(toy_job(calls, fit=fit), prepared=toy_prep(tmp_path, trace_batch_size=0))
    largest = memory.largest_batch(toy_stages(toy_prep(tmp_path, trace_batch_size=0), 3.0)["decode"], 3.0)
    [(_, prep, _, _, _)] = calls.named("process")
    assert prep.cfg.trace_batch_size == largest > 0
    assert yaml.safe_load((run.path / "config.yaml").read_text())["trace_batch_size"] == largest
    plan = json.loads((run.path / memory.PLAN_FILE).read_text())
    assert plan == json.loads(memory.plan_job(toy_stages(prep, 3.0), 3.0).to_json())


# ---- a failure the kit knows: one line, the traceback in the run folder ---------------------------------


def known_failures() -> list[BaseException]:
    import torch
    from safetensors import SafetensorError

    from opdkit.opd.teachers.served import TeacherServerError
    from opdkit.rollout.engines import WeightSyncError
    from opdkit.run.checkpoints import CheckpointUnreadable

    return [
        TeacherServerError(
            "the teacher's server at http://node7:8000 stopped answering\n(connection refused)"
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        CheckpointUnreadable("resume: cannot read runs/x/checkpoints/checkpoint-4 (Input/output error)"),
        SafetensorError("Error while deserializing header: incomplete metadata, file not fully covered"),
        ValueError("Cannot use chat template functions because tokenizer.chat_template is not set"),
        WeightSyncError("step 3: the vLLM engine's log-probabilities differ from the student's"),
    ]


@pytest.mark.parametrize("error", known_failures(), ids=lambda e: type(e).__name__)
def test_a_known_failure_is_one_line_and_its_traceback_is_kept(tmp_path, monkeypatch, capsys, error):
    """On the command line: one `error:` line on stderr naming the traceback's file, exit status 1; the file
    holds the whole traceback; in a notebook the same line (`_render_traceback_`)."""
    from opdkit.run.cli import run_from_cli

    def process(prep, run, *extra, **kwargs):
        raise error

    job = toy_job(Calls(), process=process)
    monkeypatch.setattr("opdkit.run.cli.load_config", lambda cls, mode, overrides: cls(**overrides))
    with pytest.raises(SystemExit) as stop:
        run_from_cli(
            ToyConfig, "", lambda m, o: lifecycle.run_job(job, prepared=toy_prep(tmp_path)), print, []
        )
    err = capsys.readouterr().err
    traceback_file = tmp_path / "run" / lifecycle.ERROR_FILE
    assert stop.value.code == 1 and err.count("\n") == 1 and err.startswith("error: "), err
    assert err.rstrip().endswith(f"(traceback: {traceback_file})")
    text = traceback_file.read_text()
    assert text.startswith("Traceback (most recent call last):") and type(error).__name__ in text
    assert "in process" in text  # the frame that raised
    with pytest.raises(lifecycle.RunFailed) as caught:
        lifecycle.run_job(job, prepared=toy_prep(tmp_path, overwrite=True))
    assert caught.value._render_traceback_() == [err.rstrip()]


def test_an_unknown_failure_keeps_its_traceback_and_is_written_too(tmp_path):
    def process(prep, run, *extra, **kwargs):
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        lifecycle.run_job(toy_job(Calls(), process=process), prepared=toy_prep(tmp_path))
    assert "ZeroDivisionError: a bug" in (tmp_path / "run" / lifecycle.ERROR_FILE).read_text()


def test_open_progress_bars_are_closed_before_the_error_line(tmp_path, monkeypatch, capsys):
    from tqdm import tqdm

    from opdkit.opd.teachers.served import TeacherServerError
    from opdkit.run.cli import run_from_cli

    def process(prep, run, *extra, **kwargs):
        bar = tqdm(total=10, desc="training")
        bar.update(3)
        raise TeacherServerError("the teacher's server died")

    job = toy_job(Calls(), process=process)
    monkeypatch.setattr("opdkit.run.cli.load_config", lambda cls, mode, overrides: cls(**overrides))
    with pytest.raises(SystemExit):
        run_from_cli(
            ToyConfig, "", lambda m, o: lifecycle.run_job(job, prepared=toy_prep(tmp_path)), print, []
        )
    lines = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()
    assert lines[-1].startswith("error: the teacher's server died") and "training" in lines[-2]
    assert not tqdm._instances
