"""Which checkpoint a resumed run continues from (opdkit/run/checkpoints.py): the newest one holding
every file its trainer writes; a half-written one named and removed, one lacking a file named and moved
aside, nothing removed on a read error, every process taking process 0's choice; and a real Trainer resumed
through it gives the unbroken run's losses where a checkpoint without its optimizer would not. The jobs'
end-to-end resumes are in test_jobs_whitebox.py, test_run_sharding.py, test_jobs_antidistill_students.py."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import Trainer, TrainerCallback, TrainingArguments

from opdkit.run import checkpoints
from opdkit.run.checkpoints import CheckpointUnreadable, Layout

TESTS = Path(__file__).resolve().parent
ONE = Layout()  # one process, a whole model: the tiny jobs' trainers


def _checkpoint(folder: Path, step: int, layout: Layout = ONE, weights: str = "", state: bool = True) -> Path:
    """A checkpoint-`step` holding every file of `layout` (small but real: safetensors, torch.save, JSON)."""
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True)
    weights = weights or layout.weights()[0]
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(path / weights))
    for name in layout.files():
        if name.endswith(".json") and name != "trainer_state.json":
            (path / name).write_text("{}")
        elif name != "trainer_state.json":
            torch.save({"state": torch.zeros(8)}, path / name)
    if state:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _resume(folder: Path, layout: Layout = ONE) -> tuple[Path | None, list[str]]:
    said: list[str] = []
    return checkpoints.resume_checkpoint(folder, layout, say=said.append), said


def test_a_complete_newest_checkpoint_is_taken(tmp_path):
    _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 10)
    last, said = _resume(tmp_path)
    assert last == tmp_path / "checkpoint-10"  # by step, not by name order ("10" < "2")
    assert not any("skipping" in s for s in said)


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda p: (p / "trainer_state.json").unlink(), "no trainer_state.json"),
        (lambda p: (p / "trainer_state.json").write_text('{"global_st'), "trainer_state.json is not whole"),
        (lambda p: _cut(p / "model.safetensors"), "a write cut short"),
        (lambda p: _cut(p / "model.safetensors", 0.001), "model.safetensors"),
        (lambda p: _cut(p / "optimizer.pt"), "optimizer.pt is not a whole torch archive"),
        (lambda p: _cut(p / "rng_state.pth"), "rng_state.pth is not a whole torch archive"),
        (lambda p: (p / "training_args.bin").write_bytes(b"PK\x03\x04cut"), "training_args.bin"),
    ],
)
def test_a_half_written_newest_checkpoint_is_skipped_said_and_removed(tmp_path, damage, reason):
    _checkpoint(tmp_path, 2)
    damage(_checkpoint(tmp_path, 4))
    last, said = _resume(tmp_path)
    assert last == tmp_path / "checkpoint-2"
    assert any("checkpoint-4" in s and reason in s and "removed" in s for s in said), said
    assert not (tmp_path / "checkpoint-4").exists()  # it would count against save_total_limit
    assert (tmp_path / "checkpoint-2").is_dir()


@pytest.mark.parametrize(
    "layout,missing",
    [
        (Layout(), "optimizer.pt"),  # transformers would resume with fresh AdamW moments
        (Layout(), "scheduler.pt"),  # ... and a restarted learning-rate schedule
        (Layout(), "rng_state.pth"),
        (Layout(), "training_args.bin"),
        (Layout(), "model.safetensors"),
        (Layout(processes=2), "rng_state_1.pth"),  # process 1's, written after process 0's trainer state
        (Layout(processes=2, fsdp=True), "optimizer.bin"),
        (Layout(processes=2, fsdp=True), "pytorch_model_fsdp.bin"),
        (Layout(adapter=True), "adapter_config.json"),
        (Layout(adapter=True), "adapter_model.safetensors"),
        (Layout(scaler=True), "scaler.pt"),
    ],
)
def test_a_checkpoint_lacking_a_file_is_skipped_named_and_kept_aside(tmp_path, layout, missing):
    _checkpoint(tmp_path, 2, layout)
    newest = _checkpoint(tmp_path, 4, layout)
    (newest / missing).unlink()
    kept = sorted(p.name for p in newest.iterdir())
    last, said = _resume(tmp_path, layout)
    assert last == tmp_path / "checkpoint-2"
    assert any("checkpoint-4" in s and missing in s and "incomplete-checkpoint-4" in s for s in said), said
    assert not newest.exists()  # out of the Trainer's rotation (`checkpoint-*`) and of step 4's next save
    assert sorted(p.name for p in (tmp_path / "incomplete-checkpoint-4").iterdir()) == kept
    # set aside again at the next resume that finds one: nothing is overwritten
    (_checkpoint(tmp_path, 4, layout) / missing).unlink()
    assert _resume(tmp_path, layout)[0] == tmp_path / "checkpoint-2"
    assert (tmp_path / "incomplete-checkpoint-4.2").is_dir() and (
        tmp_path / "incomplete-checkpoint-4"
    ).is_dir()


def test_a_checkpoint_of_other_settings_is_not_complete(tmp_path):
    """One written by one process lacks the RNG files of two; one saved with save_only_model lacks the
    optimizer: neither counts as complete, and neither is deleted."""
    _checkpoint(tmp_path, 2, Layout())
    last, said = _resume(tmp_path, Layout(processes=2))
    assert last is None and "rng_state_0.pth, rng_state_1.pth" in said[0], said
    assert "starts from the beginning" in said[-1]
    assert (tmp_path / "incomplete-checkpoint-2" / "optimizer.pt").is_file()
    _checkpoint(tmp_path, 4, Layout(model_only=True))
    assert _resume(tmp_path, Layout(model_only=True))[0] == tmp_path / "checkpoint-4"
    assert "optimizer.pt" in _resume(tmp_path, Layout())[1][0]


def test_shards_and_adapters(tmp_path):
    sharded = _checkpoint(tmp_path, 2)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    problem = checkpoints.checkpoint_problem(sharded, Layout())
    assert "model-00002-of-00002.safetensors" in problem.reason and not problem.partial
    save_file({"w": torch.zeros(4)}, str(sharded / "model-00002-of-00002.safetensors"))
    assert checkpoints.checkpoint_problem(sharded, Layout()) is None
    adapter = _checkpoint(tmp_path, 3, Layout(adapter=True))
    assert checkpoints.checkpoint_problem(adapter, Layout(adapter=True)) is None
    assert "no weights" in checkpoints.checkpoint_problem(adapter, Layout()).reason


def test_no_complete_checkpoint_starts_from_the_beginning(tmp_path):
    _checkpoint(tmp_path, 2, state=False)
    last, said = _resume(tmp_path)
    assert last is None and "starts from the beginning" in said[-1]
    assert _resume(tmp_path / "missing") == (None, [])


def _io_error(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error", str(args[0]))


def test_a_read_error_stops_the_resume_and_removes_nothing(tmp_path, monkeypatch):
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4, state=False)  # proven partial: removed on a resume that can read everything
    _checkpoint(tmp_path, 6)
    monkeypatch.setattr(zipfile, "ZipFile", _io_error)  # every torch file of checkpoint-6 fails to read
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(
        CheckpointUnreadable, match=r"cannot read .*checkpoint-6 .*Input/output error.*removed"
    ):
        _resume(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    monkeypatch.undo()
    assert _resume(tmp_path)[0] == tmp_path / "checkpoint-6"


def test_trainer_layout_follows_the_trainers_settings():
    def trainer(world=1, fsdp=False, peft=False, model_only=False, scaler=None, state_dict="FULL_STATE_DICT"):
        plugin = SimpleNamespace(state_dict_type=f"StateDictType.{state_dict}")
        return SimpleNamespace(
            args=SimpleNamespace(world_size=world, save_only_model=model_only),
            is_fsdp_enabled=fsdp,
            accelerator=SimpleNamespace(scaler=scaler, state=SimpleNamespace(fsdp_plugin=plugin)),
            model=SimpleNamespace(peft_config={"default": None}) if peft else SimpleNamespace(),
        )

    assert checkpoints.trainer_layout(trainer()) == Layout()
    assert checkpoints.trainer_layout(trainer(2, fsdp=True)) == Layout(processes=2, fsdp=True)
    assert checkpoints.trainer_layout(trainer(peft=True, model_only=True)) == Layout(
        adapter=True, model_only=True
    )
    assert checkpoints.trainer_layout(trainer(scaler=object())).files() == [
        "training_args.bin",
        "optimizer.pt",
        "scheduler.pt",
        "scaler.pt",
        "rng_state.pth",
        "trainer_state.json",
    ]
    assert Layout(processes=2, fsdp=True, model_only=True).files() == [
        "training_args.bin",
        "trainer_state.json",
    ]
    with pytest.raises(ValueError, match="full state dict"):
        checkpoints.trainer_layout(trainer(2, fsdp=True, state_dict="SHARDED_STATE_DICT"))


def _choose_as_one_of_two(rank: int, port: int, folder: str, out: str, unreadable: bool) -> None:
    """One of two gloo processes resuming from `folder`. Process 1 sees checkpoint-4 as cut short (a read
    that went wrong on its node only); with `unreadable`, process 0 gets an I/O error reading it."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    real = checkpoints.checkpoint_problem
    if rank == 1:
        partial = checkpoints.Problem("a cut optimizer.pt", partial=True)
        checkpoints.checkpoint_problem = lambda p, lay: partial if p.name == "checkpoint-4" else real(p, lay)
    report = {"alone": str(checkpoints.choose_checkpoint(folder, Layout(), say=lambda s: None, tidy=False))}
    if unreadable and rank == 0:
        zipfile.ZipFile = _io_error
    try:
        report["chosen"] = str(checkpoints.resume_checkpoint(folder, Layout(), say=lambda s: None))
    except CheckpointUnreadable as exc:
        report["chosen"] = f"unreadable: {exc}"
    Path(f"{out}.rank{rank}").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.parametrize("unreadable", [False, True], ids=["chosen", "unreadable"])
def test_every_process_takes_process_0s_choice(tmp_path, unreadable):
    folder = tmp_path / "checkpoints"
    _checkpoint(folder, 2), _checkpoint(folder, 4)
    out = tmp_path / "report"
    script = textwrap.dedent(f"""
        import sys, socket
        sys.path.insert(0, {str(TESTS)!r})
        from torch.multiprocessing import start_processes
        from test_run_checkpoints import _choose_as_one_of_two
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_processes(
            _choose_as_one_of_two, args=(port, {str(folder)!r}, {str(out)!r}, {unreadable}), nprocs=2,
            start_method="fork",
        )
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]
    assert reports[0]["alone"] == str(folder / "checkpoint-4")
    assert reports[1]["alone"] == str(folder / "checkpoint-2")  # on its own, process 1 would go elsewhere
    if unreadable:
        for report in reports:
            assert (
                report["chosen"].startswith("unreadable: resume: cannot read")
                and "checkpoint-4" in report["chosen"]
            )
    else:
        assert [r["chosen"] for r in reports] == [str(folder / "checkpoint-4")] * 2
    assert (folder / "checkpoint-4").is_dir()  # process 1's view removed nothing


class _Line(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {"loss": ((self.lin(x).squeeze(-1) - y) ** 2).mean()}


class _StepLosses(TrainerCallback):
    def __init__(self, stop_at: int = 0):
        self.stop_at, self.losses = stop_at, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def _train(folder: Path, resume: str | None = None, stop_at: int = 0) -> dict[int, float]:
    """A linear regression on transformers' Trainer: AdamW, a linear schedule, shuffled batches, dropout-free;
    every step's loss."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=gen)
    rows = [{"x": xi, "y": xi @ torch.tensor([1.0, -2.0, 3.0, 0.5]) + 1.0} for xi in x]
    args = TrainingArguments(
        output_dir=str(folder),
        max_steps=8,
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        save_steps=2,
        logging_steps=1,
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    torch.manual_seed(0)
    losses = _StepLosses(stop_at)
    trainer = Trainer(model=_Line(), args=args, train_dataset=rows, callbacks=[losses])
    trainer.train(resume_from_checkpoint=resume)
    return losses.losses


def test_a_resumed_trainer_gives_the_unbroken_runs_losses_and_a_checkpoint_without_optimizer_would_not(
    tmp_path,
):
    unbroken = _train(tmp_path / "unbroken")
    assert sorted(unbroken) == list(range(1, 9))
    folder = tmp_path / "broken"
    _train(folder, stop_at=6)
    last, said = _resume(folder)
    assert last == folder / "checkpoint-6"
    assert _train(tmp_path / "resumed", str(last)) == {s: unbroken[s] for s in (7, 8)}
    # What transformers does with a checkpoint that lost its optimizer and scheduler: it resumes anyway, with
    # fresh AdamW moments and a restarted schedule, and the losses part from the unbroken run's.
    (last / "optimizer.pt").unlink()
    (last / "scheduler.pt").unlink()
    stripped = _train(tmp_path / "stripped", str(last))
    assert stripped[7] == unbroken[7] and stripped[8] != pytest.approx(unbroken[8], rel=1e-3)
    last, said = _resume(folder)
    assert last == folder / "checkpoint-4" and "no optimizer.pt, scheduler.pt" in said[0], said
    assert _train(tmp_path / "from4", str(last)) == {s: unbroken[s] for s in (5, 6, 7, 8)}
