"""opdkit.rollout.ahead (issue 39): rollouts sampled ahead of training by a producer process. rollout_ahead 0
is today's synchronous run; with s = 1 the producer samples the next step while this one trains and never
more than one step ahead; unchanged weights give importance ratios of 1 and the losses of the synchronous run
(the same prompts at the same places, so the same keyed samples); the truncated correction's gradient is the
capped ratios times each token's divergence gradient, computed here by hand; a producer that dies stops the
run with one line."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import tiny_model, tiny_rollout
from datasets import Dataset
from transformers import TrainerCallback

from opdkit.config import ConfigError
from opdkit.data.prompts import PromptCollator
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.trainer import DistillTrainer
from opdkit.rollout import ahead, sampling, source
from opdkit.tasks import tiny as task

STEPS_PER_EPOCH = 3  # 24 prompts, 4 per micro-batch, 2 micro-batches a step


def _trainer(tmp_path, callbacks=(), **kw) -> DistillTrainer:
    tok = load_tokenizer("tiny:student")
    rows = [
        {"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer}
        for p in task.problems(24, 1)
    ]
    settings = dict(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        sample_every=0,
        save_strategy="no",
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        rollout_max_new_tokens=10,
        disable_tqdm=True,
        remove_unused_columns=False,
        learning_rate=1e-3,
        logging_steps=1,
        seed=0,
        data_seed=0,
    )
    return DistillTrainer(
        model=tiny_model("tiny:student"),
        args=OPDArguments(**{**settings, **kw}),
        train_dataset=Dataset.from_list(rows),
        data_collator=PromptCollator(tok, 64),
        processing_class=tok,
        teacher_model=tiny_model("tiny:teacher"),
        callbacks=list(callbacks),
    )


def _train(trainer: DistillTrainer) -> list[dict]:
    """The per-step log records (loss and the step's metrics)."""
    try:
        trainer.train()
    finally:
        trainer.close_engine()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_rollout_ahead_0_is_the_synchronous_source_with_the_same_losses(tmp_path):
    """rollout_ahead 0 builds today's `EngineRollouts` and logs the same per-step losses, to the bit, as a
    trainer handed that source explicitly; nothing of the asynchronous mode is logged."""
    zero = _trainer(tmp_path / "zero", rollout_ahead=0)
    assert type(zero.rollouts) is source.EngineRollouts and zero.rollouts.ahead == 0
    default = _trainer(tmp_path / "default")
    default.rollouts = default._engine_rollouts()
    logs0, logs = _train(zero), _train(default)
    assert [h["loss"] for h in logs0] == [h["loss"] for h in logs] and len(logs) == 3
    assert not any(k.startswith("async/") for h in logs0 for k in h)


def _versions(n_steps: int, s: int) -> list[int]:
    """Which weights sample each step (independently of the code): those of s steps before, never before the
    step that starts the epoch (an epoch's prompts cannot be peeked before the epoch starts)."""
    return [max(j - s, j - j % STEPS_PER_EPOCH) for j in range(n_steps)]


class _Slow(TrainerCallback):
    """A trainer slower than its producer: each step takes at least `seconds` more."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


STEPS = 5


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory):
    """One asynchronous run (s = 1, truncated correction) of a trainer slowed to well below its producer, at
    a zero learning rate (the producer's weights are then the trainer's at every step): its per-step logs, the
    producer's timeline by step, and when the trainer asked for each step's rollouts. One run for the tests
    below: a producer process takes seconds to start (it imports torch and transformers)."""
    trainer = _trainer(
        tmp_path_factory.mktemp("slowed"),
        [_Slow(0.4)],
        max_steps=STEPS,
        learning_rate=0.0,
        rollout_ahead=1,
        async_correction="truncated",
    )
    asked = {}
    next_step = trainer.rollouts.next_step

    def timed(student, batches, step):
        asked[step] = time.time()
        return next_step(student, batches, step)

    trainer.rollouts.next_step = timed
    logs = _train(trainer)
    return logs, {t["step"]: t for t in trainer.rollouts.timeline}, asked


def test_unchanged_weights_give_ratios_of_one_and_the_synchronous_losses(slowed_run, tmp_path):
    """With a zero learning rate the producer's weights are the trainer's at every step: the importance ratio
    is 1 to rounding on every token, and each step's loss is the synchronous run's (the peeked prompts sit
    at the same places, so the keyed samples are the same) to float32 rounding, across an epoch boundary."""
    logs_a, line, _ = slowed_run
    logs_s = _train(_trainer(tmp_path, max_steps=STEPS, learning_rate=0.0))
    assert len(logs_a) == STEPS
    for h in logs_a:
        assert abs(h["async/ratio_mean"] - 1) < 1e-5 and abs(h["async/ratio_max"] - 1) < 1e-4
        assert h["async/capped_share"] == 0
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in logs_a]),
        torch.tensor([h["loss"] for h in logs_s]),
        rtol=1e-5,
        atol=0,
    )


def test_with_s_1_the_producer_runs_ahead_but_never_more_than_one_step(slowed_run):
    """A slowed trainer: the producer starts each step j >= 1 before the trainer asks for it (it samples
    ahead, during step j - 1), and never before the trainer has begun step j - 1 (at most one step ahead);
    the records are stale by the versions the schedule gives."""
    logs, line, asked = slowed_run
    assert sorted(line) == list(range(STEPS))
    for j in range(1, STEPS):
        assert line[j]["started"] >= asked[j - 1], f"step {j} sampled before step {j - 1} began"
        if j % STEPS_PER_EPOCH:  # within an epoch: sampled while the step before trained
            assert line[j]["finished"] < asked[j], f"step {j} was not sampled ahead"
    assert [line[j]["version"] for j in range(STEPS)] == _versions(STEPS, 1)
    assert [h["async/staleness"] for h in logs] == [j - v for j, v in enumerate(_versions(STEPS, 1))]


class _Kill(TrainerCallback):
    """Kills the producer (SIGKILL) at the end of step `at`."""

    def __init__(self, trainer_box: list, at: int):
        self.box, self.at = trainer_box, at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            pid = self.box[0].rollouts.pid
            os.kill(pid, signal.SIGKILL)


def test_a_killed_producer_stops_the_run_with_one_line(tmp_path):
    box = []
    trainer = _trainer(tmp_path, [_Kill(box, 1)], max_steps=6, rollout_ahead=1)
    box.append(trainer)
    started = time.time()
    with pytest.raises(ahead.RolloutProducerDied) as err:
        _train(trainer)
    message = str(err.value)
    assert "\n" not in message and "rollout producer" in message and "exited with code -9" in message
    assert trainer.state.global_step <= 3 and time.time() - started < 60


def test_the_corrected_gradient_is_the_capped_ratios_times_each_tokens_divergence_gradient(tmp_path):
    """A record sampled by other weights (behaviour log-probs moved so that some ratios pass the cap): the
    trainer's loss and gradient equal sum_t min(exp(log p(y_t) - behaviour_t), cap) KL_t(student || teacher)
    / N, with the student's and teacher's full logits, log-softmax and the reverse KL written out here."""
    cap = 2.0
    trainer = _trainer(tmp_path, rollout_ahead=1, async_correction="truncated", async_ratio_cap=cap)
    tok = trainer.processing_class
    teacher = tiny_model("tiny:teacher")
    r = tiny_rollout(teacher, tok)
    record = source.record_of(r, [tok.eos_token_id])
    student = trainer.model
    pos_BT = sampling.position_ids_from_mask(record.attention_mask_BT)
    fwd = dict(input_ids=record.input_ids_BT, attention_mask=record.attention_mask_BT, position_ids=pos_BT)
    pred_BT, mask_BT = record.predicting_BT(), record.loss_mask_BT.bool()
    target_N = record.input_ids_BT[mask_BT]
    V = len(tok)
    with torch.no_grad():
        lp_now_N = torch.log_softmax(student(**fwd).logits[pred_BT].double(), -1).gather(
            -1, target_N[:, None]
        )[:, 0]
    shift_N = torch.linspace(
        -1.5, 0.5, target_N.shape[0], dtype=torch.float64
    )  # ratios exp(-shift): 0.6 .. 4.5
    behaviour_BT = torch.zeros(record.input_ids_BT.shape)
    behaviour_BT[mask_BT] = (lp_now_N + shift_N).float()
    stale = source.RolloutRecord(
        **{**record.__dict__, "sampling_logprobs_BT": behaviour_BT, "policy_version": 0}
    )

    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, trainer.micro_batch(stale))
    loss.backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters()}

    student.zero_grad()
    logp_s_NV = torch.log_softmax(student(**fwd).logits[pred_BT][:, :V].double(), -1)
    with torch.no_grad():
        logp_t_NV = torch.log_softmax(teacher(**fwd).logits[pred_BT][:, :V].double(), -1)
    kl_N = (logp_s_NV.exp() * (logp_s_NV - logp_t_NV)).sum(-1)
    w_N = torch.exp(-shift_N).clamp(max=cap)
    assert (w_N == cap).any() and (w_N < 1).any()
    want = (w_N * kl_N).sum() / mask_BT.sum()
    unweighted = torch.autograd.grad(
        kl_N.sum() / mask_BT.sum(), list(student.parameters()), retain_graph=True
    )
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=0)
    for (n, p), plain in zip(student.named_parameters(), unweighted):
        # float32 against float64: a relative error per tensor, far below what the weights change
        scale = p.grad.double().norm()
        assert (got[n].double() - p.grad.double()).norm() <= 1e-4 * scale, n
        assert (plain.double() - p.grad.double()).norm() > 1e-2 * scale, n


def test_the_settings_that_cannot_hold_are_one_line_errors(tmp_path):
    """Refused by the job's config, before anything loads, and by the trainer built directly."""
    with pytest.raises(ConfigError, match="rollout_ahead is 0"):
        WhiteboxConfig(async_correction="truncated")
    with pytest.raises(ConfigError, match="vLLM producer is not built yet"):
        WhiteboxConfig(rollout_ahead=1, rollout_engine="vllm")
    with pytest.raises(ConfigError, match="rollout_ahead is 0"):
        _trainer(tmp_path, async_correction="truncated")
    with pytest.raises(ConfigError, match="vLLM producer is not built yet"):
        _trainer(tmp_path, rollout_ahead=1, rollout_engine="vllm")


def test_the_producer_goes_where_rollout_device_says(tmp_path):
    """`rollout_device` is the producer's device (the records come back to the trainer's); a GPU this process
    does not see is refused in one line when the trainer is built."""
    trainer = _trainer(tmp_path, rollout_ahead=1, rollout_device="cpu")
    assert isinstance(trainer.rollouts, ahead.AheadRollouts)
    assert trainer.rollouts._args[6] == "cpu" and str(trainer.rollouts.device) == "cpu"
    gpus = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"rollout_device=cuda:{gpus} places the rollout producer on a GPU"):
        _trainer(tmp_path, rollout_ahead=1, rollout_device=f"cuda:{gpus}")


def test_the_lookahead_hands_out_the_batches_in_the_order_the_steps_take_them():
    """Peeking s steps ahead of a data iterator gives each step the batches a plain pull would have given it,
    and announces each coming step once, never more than s beyond the one taken; a new iterator starts
    afresh."""
    peek = ahead.PromptLookahead(2)
    it = iter(range(7))  # 7 batches, 2 a step: steps of [0, 1], [2, 3], [4, 5], [6]
    taken, announced = [], []
    for step in range(4):
        now, coming = peek.take(it, 2, step)
        taken.append(now)
        announced += coming
        assert all(step < s <= step + 2 for s, _ in coming)
    assert taken == [[0, 1], [2, 3], [4, 5], [6]]
    assert announced == [(1, [2, 3]), (2, [4, 5]), (3, [6])]
    now, coming = peek.take(iter("ab"), 1, 4)
    assert now == ["a"] and coming == [(5, ["b"])]
