"""Tests for opdkit.memory.components' rollout producer (`rollout_ahead`, issue 39): what the producer process
and its queue hold, counted by hand from Qwen3's published configs and from the tiny world's real model and a
real rollout record; where the producer is planned (`rollout_device`: beside the trainer, a GPU of its own,
the CPU); and `rollout_ahead` 0 planning exactly as the synchronous run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import HIDDEN, OWN_GPU, PARAMS, QUEUE, QWEN3, ROWS, VOCAB, C, P, producer_by_hand
from transformers import AutoConfig, AutoModelForCausalLM

from opdkit import memory
from opdkit.config import ConfigError, load_config
from opdkit.jobs.whitebox.config import WhiteboxConfig
from opdkit.memory import ModelShape, Stage, plan
from opdkit.models import load_tokenizer
from opdkit.opd.stage import distill_stage
from opdkit.rollout import engines, sampling, source
from opdkit.tasks import tiny as task
from opdkit.tiny import resolve


def _stage(**change) -> Stage:
    """02 full on one process (the kit's loop): the fp32 0.6B student under bf16 autocast, the bf16 4B
    teacher, 64 rows a step."""
    base = Stage(
        bf16=True,
        student=ModelShape.from_config(QWEN3["Qwen3-0.6B"]),
        teacher=ModelShape.from_config(QWEN3["Qwen3-4B"]),
        train_batch_size=4,
        sampled_rows=ROWS,
        eval_batch_size=32,
        prompt_len=P,
        completion_len=C,
    )
    return dataclasses.replace(base, **change)


def test_a_producer_beside_the_trainer_replaces_its_rollout_rows_with_the_producers_held_always():
    sync, ahead = plan(_stage(), 80), plan(_stage(rollout_ahead=1), 80)
    producer = [r for r in ahead.rows if "rollout producer" in r.component]
    assert {r.component: r.bytes for r in producer} == producer_by_hand()
    assert {r.phase for r in producer} == {memory.ALWAYS}  # it samples beside every phase of the trainer
    # Everything else is the synchronous plan's, less the rollout the trainer no longer decodes.
    rest = [r for r in ahead.rows if r not in producer]
    assert rest == [r for r in sync.rows if "student rollout" not in r.component]
    assert {r.phase for r in sync.rows if "student rollout" in r.component} == {"rollout"}
    others = max(b for phase, b in sync.phase_totals().items() if phase != "rollout")
    assert ahead.total == others + sum(producer_by_hand().values())


def test_the_queue_holds_s_plus_1_weight_copies_and_s_steps_of_records_and_prompts_in_host_memory():
    for s in (1, 3):
        job = memory.plan_job({"distillation": _stage(rollout_ahead=s)}, 80)
        queue = job.beside[QUEUE]
        assert queue.budget_bytes is None and queue.where == "in host memory"
        assert {r.component: r.bytes for r in queue.rows} == {
            "weights in the producer's queue": (s + 1) * (PARAMS + VOCAB * HIDDEN) * 4,
            "rollouts in the producer's queue": s * ROWS * ((P + C) * (8 + 8 + 8 + 4) + 1),
            "prompts planned ahead": s * ROWS * P * (8 + 8),
        }
        assert list(job.beside) == [QUEUE]  # beside the trainer: the producer is in the trainer's plan
        assert "beside the training process, " + QUEUE in job.table()
        assert job.to_dict()["beside"][QUEUE]["total_bytes"] == queue.total


def test_the_producers_rows_are_what_a_real_producer_and_a_real_record_hold():
    """The tiny student built as the producer builds it (`ahead._produce`: from its config, in fp32), the
    state_dict the trainer sends it, and a real record of the kit's loop with the sampler's log-probs."""
    config = AutoConfig.from_pretrained(resolve("tiny:student"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tok = load_tokenizer("tiny:student")
    probs = [task.problems(1, 3 + i, n_digits=1 + i % 3)[0] for i in range(6)]
    ids_BP, mask_BP = sampling.encode_prompts(tok, [[{"role": "user", "content": p.prompt}] for p in probs])
    settings = engines.SamplingSettings(
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )
    batch = {"prompts": ids_BP, "prompt_attention_mask": mask_BP}
    loop = source.EngineRollouts(lambda: engines.make_engine("hf", logprobs=True), settings, 0, 0, 1, 6)
    (record,) = loop.next_step(model, [batch], 0)
    B, T = record.input_ids_BT.shape
    held = sum(t.numel() * t.element_size() for t in (*record.tensors().values(), record.truncated_B))
    stage = Stage(
        student=ModelShape.from_config(config),
        device="cuda",
        sampled_rows=B,
        prompt_len=ids_BP.shape[1],
        completion_len=T - ids_BP.shape[1],
        rollout_ahead=1,
    )
    rows = {r.component: r.bytes for r in memory.components_of(stage, None)}
    assert rows["rollout producer weights"] == sum(p.numel() * p.element_size() for p in model.parameters())
    sent = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    assert rows["rollout producer weight update"] == sent
    queue = {r.component: r.bytes for r in memory.components.queue_components(stage)}
    assert queue["weights in the producer's queue"] == 2 * sent
    assert queue["rollouts in the producer's queue"] == held
    assert queue["prompts planned ahead"] == sum(t.numel() * t.element_size() for t in batch.values())


def test_a_producer_on_a_gpu_of_its_own_is_planned_there_with_its_own_reserve_and_verdict():
    job = memory.plan_job({"distillation": _stage(rollout_ahead=1, producer_place="gpu")}, 80)
    trainer, own = job.plan, job.beside[OWN_GPU]
    assert not [r for r in trainer.rows if "rollout" in r.component]
    assert {r.component: r.bytes for r in own.rows} == {**producer_by_hand(), "reserve": 4e9}
    assert own.budget_bytes == 80e9 and own.fits and job.fits
    assert list(job.beside) == [OWN_GPU, QUEUE]
    # 256 rows of fp32 cache (120 GB) do not fit the producer's GPU, though the trainer's plan still does.
    job = memory.plan_job(
        {"distillation": _stage(rollout_ahead=1, producer_place="gpu", sampled_rows=256)}, 80
    )
    assert job.plan.fits and not job.fits
    assert job.table().splitlines()[-1].endswith(f"GB of 80.0 GB per process: does not fit at {OWN_GPU}")
    with pytest.raises(ConfigError, match=f"does not fit at {OWN_GPU}"):
        job.check()
    cpu = memory.plan_job({"distillation": _stage(rollout_ahead=1, producer_place="cpu")}, 80)
    rows = {r.component for r in cpu.beside["the rollout producer on the CPU"].rows}
    assert "rollout producer weight update" not in rows  # a CPU producer loads the shared tensors in place
    assert "KV cache, rollout producer" in rows


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_rollout_ahead_0_plans_as_the_synchronous_run_wherever_rollout_device_would_put_it(engine):
    sync = memory.plan_job({"d": _stage(rollout_engine=engine)}, 80, gpu_gb=141)
    for place in ("beside", "gpu", "cpu"):
        job = memory.plan_job({"d": _stage(rollout_engine=engine, producer_place=place)}, 80, gpu_gb=141)
        assert job.to_json() == sync.to_json() and job.table() == sync.table()
    assert not sync.beside and "beside" not in sync.to_dict()
    assert not [r for r in sync.plan.rows if "producer" in r.component]


def test_rollout_device_places_the_producer_for_the_plan_and_is_checked_in_one_line():
    cfg = load_config(WhiteboxConfig, "tiny", {"rollout_ahead": 1})
    for device, budget, place in [
        ("", None, "beside"),
        ("cpu", None, "beside"),  # a CPU run: the trainer's memory is the host's
        ("", 80.0, "beside"),
        ("cuda:0", 80.0, "beside"),
        ("cuda:1", 80.0, "gpu"),
        ("cpu", 80.0, "cpu"),
    ]:
        stage = distill_stage(dataclasses.replace(cfg, rollout_device=device), 1, budget)
        assert (stage.rollout_ahead, stage.producer_place) == (1, place), device
    assert distill_stage(load_config(WhiteboxConfig, "tiny", {}), 1, None).rollout_ahead == 0
    with pytest.raises(ConfigError, match="rollout_device='gpu1' is not a device"):
        WhiteboxConfig(rollout_ahead=1, rollout_device="gpu1")
    with pytest.raises(ConfigError, match="rollout_ahead is 0"):
        WhiteboxConfig(rollout_device="cuda:1")
