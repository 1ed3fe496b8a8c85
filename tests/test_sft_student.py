"""Students distilled by completion-only SFT (opdkit.sft.student) on transformers' Trainer: the same losses
and weights as a plain PyTorch loop with the same batches, schedule and optimizer; LoRA students that train,
save, reload and score the same; resume from a checkpoint, refused on other traces; the metrics reach
report_to; the SFT seed over repeats; a truncated trace's rows without an invented end of turn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import Interrupted
from transformers import TrainerCallback, get_cosine_schedule_with_warmup

from opdkit import tasks
from opdkit.config import ConfigError, load_config
from opdkit.data import traces
from opdkit.data.labels import IGNORE, make_batches, shifted_labels, token_losses
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.models import load_tokenizer
from opdkit.sft import student as students
from opdkit.sft import trainer as sft
from opdkit.tasks import evaluate
from opdkit.tasks import tiny as task


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny:student")


def _records(n: int = 20, seed: int = 5) -> list[dict]:
    return [
        traces.trace([{"role": "user", "content": p.prompt}], task.scratchpad(p))
        for p in task.problems(n, seed)
    ]


def _cfg(**over):
    """A job's config composing `SFTSettings` (04's)."""
    base = {
        "sft_max_steps": 4,
        "sft_batch_size": 8,
        "sft_micro_batch_size": 3,
        "sft_learning_rate": 3e-3,
        "sft_warmup_ratio": 0.25,
        "sft_weight_decay": 0.0,
        "student_save": "none",
    }
    return load_config(AntidistillConfig, "tiny", {**base, **over})


def _plain_loop_losses(cfg, rows, pad: int, seed: int) -> tuple[list[float], torch.nn.Module]:
    """The reference: plain PyTorch on the same step batches (`batch_order`, micro-batches of
    `sft_micro_batch_size`), AdamW, linear warmup then cosine, clipping at 1; each step's summed token losses
    divided by all of the step's completion tokens (what 04's students ran on before the Trainer)."""
    model = students.fresh_student(cfg, torch.device("cpu"), seed)
    steps, micro = cfg.sft_max_steps, cfg.sft_micro_batch_size
    order = sft.batch_order(len(rows), cfg.sft_batch_size, steps, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_learning_rate, weight_decay=cfg.sft_weight_decay)
    sched = get_cosine_schedule_with_warmup(opt, round(cfg.sft_warmup_ratio * steps), steps)
    losses = []
    model.train()
    for idx in order:
        batches = [
            next(make_batches(rows, idx[s : s + micro], micro, pad, "cpu")) for s in range(0, len(idx), micro)
        ]
        n_tokens = sum(int((shifted_labels(b["labels"]) != IGNORE).sum()) for b in batches)
        total = 0.0
        for batch in batches:
            loss = token_losses(model, batch)[0].sum() / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, model.eval()


def test_trainer_gives_the_losses_and_weights_of_a_plain_loop(tok, tmp_path):
    """Micro-batches of 3, 3 and 2 rows per step: the step's loss is the token mean of the whole step."""
    cfg = _cfg()
    rows = students.sft_rows(_records(), tok, cfg)
    expected, model = _plain_loop_losses(cfg, rows, tok.pad_token_id, seed=7)
    trainer = students.distill(
        students.fresh_student(cfg, torch.device("cpu"), 7), rows, cfg, tok, 7, tmp_path
    )
    log = trainer.step_log()
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert [r["loss"] for r in log] == pytest.approx(expected, rel=1e-5)
    assert log[0]["learning_rate"] == 0.0 and log[1]["learning_rate"] == pytest.approx(3e-3)  # 1 warmup step
    for (name, a), b in zip(model.named_parameters(), trainer.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_student_trains_saves_reloads_and_scores_the_same(tok, tmp_path):
    cfg = _cfg(
        student_lora_r=8,
        student_lora_alpha=16,
        sft_max_steps=6,
        sft_micro_batch_size=0,
        sft_learning_rate=1e-2,
        sft_warmup_ratio=0.05,
        student_save="adapter",
    )
    dev = torch.device("cpu")
    rows = students.sft_rows(_records(), tok, cfg)
    base = students.fresh_student(cfg, dev, 3)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters()}
    trainer = students.distill(base, rows, cfg, tok, 3, tmp_path)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.step_log()[-1]["loss"] < trainer.step_log()[0]["loss"]
    merged = students.keep_student(trainer.model, cfg, tok, tmp_path)
    assert (tmp_path / "student" / "adapter_config.json").is_file()
    assert (tmp_path / "student" / "adapter_model.safetensors").stat().st_size < 2e6
    assert any(
        not torch.equal(frozen[n], p) for n, p in merged.named_parameters()
    )  # the adapter moved weights
    again = students.load_student(cfg, tmp_path, 3, dev)
    for (name, a), b in zip(merged.named_parameters(), again.parameters()):
        torch.testing.assert_close(a, b, msg=name)
    tiny_task = tasks.get_task("tiny")
    messages, answers = tiny_task.heldout(24)

    def scores(model):  # what 04 reports for a student: raw and forced greedy accuracy
        return evaluate.accuracy(model, tok, tiny_task, messages, answers, max_new_tokens=40, forced=True)

    assert scores(again) == scores(merged)
    held = rows[:8]
    assert students.holdout_loss(again, held, tok.pad_token_id, 4) == students.holdout_loss(
        merged, held, tok.pad_token_id, 4
    )


def test_merged_save_reloads_as_a_plain_model(tok, tmp_path):
    cfg = _cfg(student_lora_r=4, student_save="merged", sft_max_steps=2)
    rows = students.sft_rows(_records(8), tok, cfg)
    trainer = students.distill(
        students.fresh_student(cfg, torch.device("cpu"), 1), rows, cfg, tok, 1, tmp_path
    )
    merged = students.keep_student(trainer.model, cfg, tok, tmp_path)
    assert not (tmp_path / "student" / "adapter_config.json").exists()
    again = students.load_student(cfg, tmp_path, 1, torch.device("cpu"))
    for a, b in zip(merged.parameters(), again.parameters()):
        torch.testing.assert_close(a, b)


class _StopAt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class _KilledWhileSaving(sft.CompletionSFTTrainer):
    """Dies while writing checkpoint-4: its adapter half-written, no optimizer, no trainer_state.json."""

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.state.global_step == 4:
            weights = Path(output_dir) / "adapter_model.safetensors"
            weights.write_bytes(weights.read_bytes()[:500])
            raise Interrupted("killed while writing checkpoint-4")
        super()._save_optimizer_and_scheduler(output_dir)


def test_an_interrupted_student_resumes_from_its_checkpoint(tok, tmp_path, monkeypatch):
    """Stopped after step 2, and killed while writing checkpoint-4 beside a complete checkpoint-2: both
    continue from checkpoint-2 to the losses and weights of an unbroken run."""
    cfg = _cfg(sft_checkpoint_every=2, student_lora_r=4)
    rows = students.sft_rows(_records(), tok, cfg)
    whole = students.distill(
        students.fresh_student(cfg, torch.device("cpu"), 2), rows, cfg, tok, 2, tmp_path / "whole"
    )

    class Stopped(sft.CompletionSFTTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(_StopAt(2))

    plain = sft.CompletionSFTTrainer  # `students.distill` takes it from its module when it trains
    monkeypatch.setattr(sft, "CompletionSFTTrainer", Stopped)
    first = students.distill(
        students.fresh_student(cfg, torch.device("cpu"), 2), rows, cfg, tok, 2, tmp_path / "stopped"
    )
    assert first.state.global_step == 2 and (tmp_path / "stopped" / "sft" / "checkpoint-2").is_dir()
    monkeypatch.setattr(sft, "CompletionSFTTrainer", _KilledWhileSaving)
    with pytest.raises(Interrupted):
        students.distill(
            students.fresh_student(cfg, torch.device("cpu"), 2), rows, cfg, tok, 2, tmp_path / "cut"
        )
    cut = tmp_path / "cut" / "sft"
    assert (cut / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (cut / "checkpoint-4" / "trainer_state.json").exists()
    monkeypatch.setattr(sft, "CompletionSFTTrainer", plain)
    resumed_cfg = _cfg(sft_checkpoint_every=2, student_lora_r=4, resume=True)
    for name in ("stopped", "cut"):
        second = students.distill(
            students.fresh_student(cfg, torch.device("cpu"), 2), rows, resumed_cfg, tok, 2, tmp_path / name
        )
        assert [r["step"] for r in second.step_log()] == [3, 4], name
        assert [r["loss"] for r in second.step_log()] == pytest.approx(
            [r["loss"] for r in whole.step_log()][2:], rel=1e-5
        )
        for a, b in zip(whole.model.parameters(), second.model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_student_checkpoint_trained_on_other_traces_is_refused(tok, tmp_path):
    """Each checkpoint records the hash of the rows it trained on; resuming it on other rows is refused."""
    cfg = _cfg(sft_checkpoint_every=2, sft_max_steps=2)
    rows = students.sft_rows(_records(), tok, cfg)
    students.distill(students.fresh_student(cfg, torch.device("cpu"), 2), rows, cfg, tok, 2, tmp_path)
    checkpoint = tmp_path / "sft" / "checkpoint-2"
    assert (checkpoint / sft.TRAINED_ON_FILE).read_text().strip() == sft.rows_sha256(rows)
    assert sft.trained_on_problem(checkpoint, rows) is None
    other = students.sft_rows(_records(seed=6), tok, cfg)
    resumed = _cfg(sft_checkpoint_every=2, sft_max_steps=2, resume=True)
    with pytest.raises(ConfigError, match="traces changed since it was saved.*Delete .*sft"):
        students.distill(
            students.fresh_student(cfg, torch.device("cpu"), 2), other, resumed, tok, 2, tmp_path
        )
    (checkpoint / sft.TRAINED_ON_FILE).unlink()
    with pytest.raises(ConfigError, match="records no hash"):
        students.distill(students.fresh_student(cfg, torch.device("cpu"), 2), rows, resumed, tok, 2, tmp_path)


def test_sft_metrics_and_final_scores_reach_report_to(tok, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(report_to="tensorboard", sft_max_steps=3)
    rows = students.sft_rows(_records(8), tok, cfg)
    trainer = students.distill(
        students.fresh_student(cfg, torch.device("cpu"), 1), rows, cfg, tok, 1, tmp_path
    )
    trainer.log({"student_accuracy": 0.25})  # what run_once sends after evaluating (the writer flushes)
    (events,) = {p.parent for p in (tmp_path / "sft").rglob("events.out.tfevents*")}
    scalars = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/student_accuracy"} <= set(scalars)


def test_sft_seed_follows_the_repeats():
    base = load_config(AntidistillConfig, "tiny", {"seed": 42})
    assert [students.sft_seed(base, s) for s in (42, 43)] == [42, 43]
    fixed = load_config(AntidistillConfig, "tiny", {"seed": 42, "sft_seed": 69})
    assert [students.sft_seed(fixed, s) for s in (42, 43)] == [69, 70]


def test_students_learn_no_invented_end(tiny_tokenizer):
    """A trace the teacher did not finish keeps no end-of-turn target it never wrote."""
    cfg = load_config(AntidistillConfig, "tiny")
    prompt = [{"role": "user", "content": "What is 2+3+4?"}]
    recs = [
        traces.trace(prompt, "3+2=5", truncated=True),
        traces.trace(prompt, "3+2=5;5", truncated=False),
    ]
    cut, whole = (
        tiny_tokenizer.decode([t for t in r["labels"] if t != IGNORE])
        for r in students.sft_rows(recs, tiny_tokenizer, cfg)
    )
    assert (cut, whole) == ("3+2=5", "3+2=5;5<|im_end|>")
