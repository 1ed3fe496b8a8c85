"""opdkit.rollout.ahead (issue 39): rollouts sampled ahead of training by a producer process. rollout_ahead 0
is today's synchronous run; with s = 1 the producer samples the next step while this one trains and never
more than one step ahead; unchanged weights give importance ratios of 1 and the losses of the synchronous run
(the same prompts at the same places, so the same keyed samples); the truncated correction's gradient is the
capped ratios times each token's divergence gradient, computed here by hand; a producer that dies stops the
run with one line; a resumed run (after a checkpoint, or after its producer died) regenerates its queued
steps with the weights that sampled them and equals the unbroken run; 2 processes, each with its producer,
take the one-process run's steps."""

from __future__ import annotations

import functools
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, tiny_rollout, tiny_trainer, train_logs
from safetensors.torch import load_file
from transformers import TrainerCallback

from opdkit.config import ConfigError
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.rollout import ahead, build, sampling, source
from opdkit.rollout.weights import Weights, logprobs_under

STEPS_PER_EPOCH = 3  # 24 prompts, 4 per micro-batch, 2 micro-batches a step


def test_rollout_ahead_0_is_the_synchronous_source_with_the_same_losses(tmp_path):
    """rollout_ahead 0 builds today's `EngineRollouts` and logs the same per-step losses, to the bit, as a
    trainer handed that source explicitly; nothing of the asynchronous mode is logged."""
    zero = tiny_trainer(tmp_path / "zero", rollout_ahead=0)
    assert type(zero.rollouts) is source.EngineRollouts and zero.rollouts.ahead == 0
    default = tiny_trainer(tmp_path / "default")
    default.rollouts = build.rollout_source(
        default.args, default.model, default.processing_class, default.stop_ids, sharded=False
    )
    logs0, logs = train_logs(zero), train_logs(default)
    assert [h["loss"] for h in logs0] == [h["loss"] for h in logs] and len(logs) == 3
    assert not any(k.startswith("async/") for h in logs0 for k in h)


def _versions(n_steps: int, s: int, per_epoch: int = STEPS_PER_EPOCH) -> list[int]:
    """Which weights sample each step (independently of the code): those of s steps before, never before the
    step that starts the epoch (an epoch's prompts cannot be peeked before the epoch starts)."""
    return [max(j - s, j - j % per_epoch) for j in range(n_steps)]


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
    trainer = tiny_trainer(
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
    logs = train_logs(trainer)
    return logs, {t["step"]: t for t in trainer.rollouts.timeline}, asked


def test_unchanged_weights_give_ratios_of_one_and_the_synchronous_losses(slowed_run, tmp_path):
    """With a zero learning rate the producer's weights are the trainer's at every step: the importance ratio
    is 1 to rounding on every token, and each step's loss is the synchronous run's (the peeked prompts sit
    at the same places, so the keyed samples are the same) to float32 rounding, across an epoch boundary."""
    logs_a, line, _ = slowed_run
    logs_s = train_logs(tiny_trainer(tmp_path, max_steps=STEPS, learning_rate=0.0))
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
    trainer = tiny_trainer(tmp_path, [_Kill(box, 1)], max_steps=6, rollout_ahead=1)
    box.append(trainer)
    started = time.time()
    with pytest.raises(ahead.RolloutProducerDied) as err:
        train_logs(trainer)
    message = str(err.value)
    assert "\n" not in message and "rollout producer" in message and "exited with code -9" in message
    assert trainer.state.global_step <= 3 and time.time() - started < 60


def test_the_log_probs_under_a_versions_weights_are_that_models_own(tmp_path):
    """`weights.logprobs_under(model, weights, …)` equals, to float32 rounding, the log-softmax of the full
    logits of a separate copy of the model holding them (other weights than the model's, tied embedding
    included), at the positions the mask marks; the model's own weights are left alone."""
    import copy

    model = tiny_model("tiny:student")
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids_BT = torch.randint(3, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    attn_BT = torch.ones_like(ids_BT)
    attn_BT[0, :2] = 0  # a left-padded row
    pred_BT = torch.zeros_like(ids_BT, dtype=torch.bool)
    pred_BT[:, 4:8] = True
    pos_BT = sampling.position_ids_from_mask(attn_BT)
    fwd = dict(input_ids=ids_BT, attention_mask=attn_BT, position_ids=pos_BT, use_cache=False)
    target_N = ids_BT[:, 1:][pred_BT[:, :-1]]
    got_N = logprobs_under(model, Weights.copy_of(other), fwd, pred_BT, target_N, chunk_size=5)
    with torch.no_grad():
        logp_BTV = torch.log_softmax(other(**fwd).logits.double(), dim=-1)
    want_N = logp_BTV[pred_BT].gather(1, target_N[:, None]).squeeze(1)
    torch.testing.assert_close(got_N.double(), want_N, rtol=0, atol=2e-5)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_sampler_gap_is_measured_against_the_weights_that_sampled(tmp_path):
    """rollout_ahead 1 with a learning rate: each step's `async/sampler_logprob_gap` (the producer's
    log-probs against the weights of the version that sampled them) is 0 to float32 rounding (the same
    weights, the loop's KV-cached decode against one full forward: < 1e-4), while `engine_logprob_gap`,
    against the current weights, is far larger on every step sampled by older weights."""
    logs = train_logs(tiny_trainer(tmp_path, max_steps=5, rollout_ahead=1))  # learning rate 1e-3
    assert len(logs) == 5
    for h in logs:
        assert 0 <= h["async/sampler_logprob_gap"] < 1e-4, h
    stale = [h for h in logs if h["async/staleness"]]
    assert len(stale) >= 3
    for h in stale:
        gap = h["engine_logprob_gap"]
        assert gap > 1e-3 and gap > 100 * h["async/sampler_logprob_gap"]


def _corrupt_loads(make):
    """An engine factory whose engine samples with a head 1.5 times the one it was sent: a producer whose
    weight load went wrong (module level: pickled into the spawned producer)."""
    engine = make()
    sample = engine.sample

    def corrupted(model, *args, **kwargs):
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(1.5)
        try:
            return sample(model, *args, **kwargs)
        finally:
            with torch.no_grad():
                model.get_output_embeddings().weight.div_(1.5)

    engine.sample = corrupted
    return engine


def test_a_producer_that_loaded_other_weights_stops_the_run_with_one_line(tmp_path):
    """A producer whose engine samples with other weights than those it was sent: the first step's sampler
    gap is off, and the run stops before its first update with the synchronous check's one-line
    `WeightSyncError`."""
    from opdkit.rollout.engines import WeightSyncError

    trainer = tiny_trainer(tmp_path, max_steps=4, rollout_ahead=1)
    trainer.rollouts.make_engine = functools.partial(_corrupt_loads, trainer.rollouts.make_engine)
    with pytest.raises(WeightSyncError) as err:
        train_logs(trainer)
    message = str(err.value)
    assert "\n" not in message and message.startswith("step 1: the rollout producer's log-probabilities")
    assert trainer.state.global_step == 0


def test_the_corrected_gradient_is_the_capped_ratios_times_each_tokens_divergence_gradient(tmp_path):
    """A record sampled by other weights (behaviour log-probs moved so that some ratios pass the cap): the
    trainer's loss and gradient equal sum_t min(exp(log p(y_t) - behaviour_t), cap) KL_t(student || teacher)
    / N, with the student's and teacher's full logits, log-softmax and the reverse KL written out here."""
    cap = 2.0
    trainer = tiny_trainer(tmp_path, rollout_ahead=1, async_correction="truncated", async_ratio_cap=cap)
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
    """Refused by the job's config, before anything loads, and by the trainer built directly; a vLLM producer
    where vllm is not installed is refused by the trainer, before any producer starts."""
    with pytest.raises(ConfigError, match="rollout_ahead is 0"):
        WhiteboxConfig(async_correction="truncated")
    with pytest.raises(ConfigError, match="rollout_ahead is 0"):
        tiny_trainer(tmp_path, async_correction="truncated")
    assert WhiteboxConfig(rollout_ahead=1, rollout_engine="vllm").rollout_ahead == 1
    with pytest.raises(ConfigError, match="set vllm_sleep false"):
        WhiteboxConfig(rollout_ahead=1, rollout_engine="vllm", vllm_sleep=True)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="needs the vllm package") as err:
            tiny_trainer(tmp_path, rollout_ahead=1, rollout_engine="vllm")
        assert "\n" not in str(err.value)


def test_the_producer_goes_where_rollout_device_says(tmp_path):
    """`rollout_device` is the producer's device (the records come back to the trainer's); a GPU this process
    does not see is refused in one line when the trainer is built."""
    trainer = tiny_trainer(tmp_path, rollout_ahead=1, rollout_device="cpu")
    assert isinstance(trainer.rollouts, ahead.AheadRollouts)
    assert trainer.rollouts.rollout_device == "cpu" and str(trainer.rollouts.device) == "cpu"
    gpus = torch.cuda.device_count()
    with pytest.raises(ConfigError, match=f"rollout_device=cuda:{gpus} places the rollout producer on a GPU"):
        tiny_trainer(tmp_path, rollout_ahead=1, rollout_device=f"cuda:{gpus}")


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


RESUME = dict(prompts=48, max_steps=6, save_strategy="steps", save_steps=2, rollout_temperature=1.0)
RESUME_EPOCH = 6  # 48 prompts, 8 a step: one epoch


class _Logged(TrainerCallback):
    """Each optimizer step's (loss, staleness), by global step."""

    def __init__(self):
        self.steps = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.steps[state.global_step] = (logs["loss"], logs.get("async/staleness"))


def _logged_run(folder, callbacks=(), resume=None, **kw) -> dict[int, tuple]:
    logged = _Logged()
    trainer = tiny_trainer(folder, [logged, *callbacks], **{**RESUME, **kw})
    try:
        trainer.train(resume_from_checkpoint=resume)
    finally:
        trainer.close_engine()
    return logged.steps


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """Unbroken asynchronous runs (s = 1, 2) of one 6-step epoch, checkpointed every 2 steps."""
    runs = {}

    def run(s):
        if s not in runs:
            folder = tmp_path_factory.mktemp(f"unbroken{s}")
            runs[s] = folder, _logged_run(folder, rollout_ahead=s)
        return runs[s]

    return run


def _assert_same_steps(got: dict, want: dict) -> None:
    assert sorted(got) and set(got) <= set(want)
    assert [got[k][1] for k in sorted(got)] == [want[k][1] for k in sorted(got)]  # the same staleness
    torch.testing.assert_close(
        torch.tensor([got[k][0] for k in sorted(got)]),
        torch.tensor([want[k][0] for k in sorted(got)]),
        rtol=1e-5,
        atol=0,
    )


@pytest.mark.parametrize("s", [pytest.param(1, marks=pytest.mark.slow), 2])  # s = 2 keeps two versions
def test_a_resumed_asynchronous_run_regenerates_its_queued_steps_and_equals_the_unbroken_run(
    unbroken, tmp_path, s
):
    """checkpoint-4 keeps the steps then queued (4 … 3 + s, 0-based) with the versions of the weights that
    sample them (s steps before, as the schedule says) and those weights (version 2's are checkpoint-2's
    model); resumed from it, the run logs the unbroken run's staleness and per-step losses."""
    folder, want = unbroken(s)
    plans, weights = ahead.load_queued(folder / "checkpoint-4")
    schedule = _versions(6, s, RESUME_EPOCH)
    assert plans == {j: schedule[j] for j in range(4, 4 + s)}
    assert sorted(weights) == sorted(set(plans.values()))
    if 2 in weights:
        model = load_file(str(folder / "checkpoint-2" / "model.safetensors"))
        for name, t in model.items():
            torch.testing.assert_close(weights[2].state()[name], t, rtol=0, atol=0)
    assert ahead.load_queued(folder / "checkpoint-6")[0] == {}  # the epoch's end: nothing queued
    got = _logged_run(tmp_path, resume=str(folder / "checkpoint-4"), rollout_ahead=s)
    assert sorted(got) == [5, 6] and got[5][1] == s
    _assert_same_steps(got, want)


def test_a_run_whose_producer_died_resumes_from_its_last_checkpoint_to_the_unbroken_runs_losses(
    unbroken, tmp_path
):
    """The producer killed after step 3 (s = 1): the run stops with RolloutProducerDied; resumed from
    checkpoint-2 it logs the unbroken run's steps 3 … 6."""
    _, want = unbroken(1)
    box = []
    with pytest.raises(ahead.RolloutProducerDied):
        logged = _Logged()
        trainer = tiny_trainer(tmp_path / "broken", [logged, _Kill(box, 3)], **{**RESUME, "rollout_ahead": 1})
        box.append(trainer)
        try:
            trainer.train()
        finally:
            trainer.close_engine()
    assert (tmp_path / "broken" / "checkpoint-2").is_dir()
    assert not (tmp_path / "broken" / "checkpoint-4").exists()
    got = _logged_run(tmp_path / "resumed", resume=str(tmp_path / "broken" / "checkpoint-2"), rollout_ahead=1)
    assert sorted(got) == [3, 4, 5, 6]
    _assert_same_steps(got, want)


@pytest.mark.slow
def test_two_gloo_processes_each_with_its_producer_take_the_one_process_runs_steps(tmp_path):
    """rollout_ahead 1 in 2 gloo processes, each with its own producer sampling its rows of the step's global
    batch (keyed by place), against 1 process with rollout_ahead 1 at the same global batch (8, micro-batches
    of 2): the same per-step losses and importance ratios (relative 1e-5) and staleness over 4 steps of one
    epoch."""
    from helpers import FIXED, run_tiny

    from opdkit.run.files import read_jsonl

    common = {
        **FIXED,
        "max_steps": 4,
        "save_rollouts": False,
        "per_device_train_batch_size": 2,
        "global_batch_size": 8,
        "rollout_temperature": 1.0,
        "rollout_ahead": 1,
    }
    script = textwrap.dedent(f"""
        import torch; torch.set_num_threads(1)
        from opdkit.jobs import whitebox
        if __name__ == "__main__":
            over = {common!r}
            whitebox.run("tiny", {{**over, "run_dir": {str(tmp_path / "two")!r}, "num_processes": 2}})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600)
    one_run = run_tiny(tmp_path, "one", **common)
    steps = {}
    for name, path in (("one", one_run.path), ("two", tmp_path / "two")):
        steps[name] = [r for r in read_jsonl(path / "metrics.jsonl") if "loss" in r and "grad_norm" in r]
    one, two = steps["one"], steps["two"]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    assert [r["async/staleness"] for r in two] == [r["async/staleness"] for r in one] == [0, 1, 1, 1]
    for key in ("loss", "async/ratio_mean"):  # the ratios' mean over both processes' tokens
        torch.testing.assert_close(
            torch.tensor([r[key] for r in two]), torch.tensor([r[key] for r in one]), rtol=1e-5, atol=0
        )


def test_a_producer_on_a_gpu_of_its_own_sees_that_gpu_alone(monkeypatch):
    """`rollout_device cuda:N`: the producer's process sees the N-th GPU the trainer sees, as cuda:0."""
    from opdkit.rollout.ahead import only_gpu

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert only_gpu("cuda:1") == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert only_gpu("cuda:2") == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert only_gpu("cpu") == "cpu" and only_gpu("cuda") == "cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


ROOT = Path(__file__).resolve().parent.parent
ORPHAN = """
import functools, sys, time
from opdkit.models import load_model
from opdkit.rollout import ahead, engines
student = load_model("tiny:student")
settings = engines.SamplingSettings(
    max_new_tokens=4, temperature=1.0, top_p=1.0, eos_token_ids=[0], pad_token_id=0
)
make = functools.partial(engines.make_engine, "hf", logprobs=True)
source = ahead.AheadRollouts(make, student.config, settings, 0, 0, 1, 2, 1, "cpu")
source.open()
print(source.pid, flush=True)
time.sleep(600)
"""


def test_a_producer_whose_trainer_was_killed_exits_by_itself(tmp_path):
    """A trainer killed outright cannot send "stop": its producer notices it was re-parented and exits."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env()
    )
    producer = int(trainer.stdout.readline())
    trainer.kill()
    trainer.wait()
    deadline = time.time() + 4 * ahead.ORPHAN_POLL_S + 30
    while time.time() < deadline and _alive(producer):
        time.sleep(0.5)
    assert not _alive(producer), "the orphaned producer still runs"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(")")[-1].split()[0] != "Z"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
