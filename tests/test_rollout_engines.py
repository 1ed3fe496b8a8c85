"""The rollout-engine seam: the engine-neutral Rollout assembly, seeding and greedy settings, and the error
that names both remedies when vLLM is missing. (The step's micro-batches: test_rollout_microbatches.py; vLLM
itself: test_rollout_engines_vllm.py.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import hf_greedy, micro_batches
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.config import ConfigError
from opdkit.jobs import whitebox
from opdkit.jobs.whitebox import job as wb_job
from opdkit.models import load_tokenizer
from opdkit.rollout import engines, microbatches, sampling


@pytest.fixture(scope="module")
def student_tok():
    return AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")), load_tokenizer("tiny:student")


def settings(tok, max_new_tokens=12):
    return engines.SamplingSettings(max_new_tokens, 1.0, 1.0, [tok.eos_token_id], tok.pad_token_id)


def test_hf_engine_is_seeded_by_the_seed_it_is_given(student_tok):
    model, tok = student_tok
    ids, mask = microbatches.concat_prompts(micro_batches(tok), tok.pad_token_id)
    eng = engines.make_engine("hf")
    a, b = (eng.sample(model, ids, mask, settings(tok), seed=5) for _ in range(2))
    torch.testing.assert_close(a.input_ids_BT, b.input_ids_BT)
    assert a.logprobs_BC is None


def test_assemble_masks_like_the_hf_loop():
    s = engines.SamplingSettings(5, 1.0, 1.0, [7], 0)
    ids, mask = torch.tensor([[0, 4], [3, 4]]), torch.tensor([[0, 1], [1, 1]])
    r = sampling.assemble(ids, mask, [[5, 7], [5, 6, 6]], [[-0.5, -0.25], [-1.0, -2.0, -3.0]], s)
    assert r.completion_mask_BC.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert r.completion_ids_BC.tolist() == [[5, 7, 0], [5, 6, 6]]
    assert r.truncated_B(7).tolist() == [False, True]
    assert r.logprobs_BC.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]


def test_logprob_gap_is_zero_for_the_models_own_logprobs(student_tok):
    model, tok = student_tok
    ids, mask = microbatches.concat_prompts(micro_batches(tok), tok.pad_token_id)
    torch.manual_seed(0)
    r = sampling.sample(
        model, ids, mask, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_new_tokens=10
    )
    with torch.no_grad():
        logits = model(
            input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT
        ).logits[:, r.prompt_len - 1 : -1]
    lp = torch.log_softmax(logits, -1).gather(-1, r.completion_ids_BC[..., None])[..., 0]
    r.logprobs_BC = lp * r.completion_mask_BC
    gap, n = engines.logprob_gap(model, r, chunk=3)
    assert n == r.completion_mask_BC.sum().item() and gap / n < 1e-5
    r.logprobs_BC = r.logprobs_BC + 0.5 * r.completion_mask_BC
    gap, n = engines.logprob_gap(model, r)
    assert gap / n == pytest.approx(0.5, abs=1e-4)


def test_check_sync_stops_above_the_tolerance_of_the_engines_dtype():
    engines.check_sync(5e-4 * 100, 100, "float32", step=1)
    engines.check_sync(0.05 * 100, 100, "bfloat16", step=1)
    engines.check_sync(0.0, 0, "float32", step=1)  # no sampled token: nothing to judge
    for gap, dtype in ((2e-3, "float32"), (0.2, "bfloat16"), (float("nan"), "float32")):
        with pytest.raises(
            engines.WeightSyncError, match=rf"step 3: .* {dtype} engine.*the weight sync is wrong"
        ):
            engines.check_sync(gap * 100, 100, dtype, step=3)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_prepare_without_vllm_names_both_remedies(tmp_path):
    with pytest.raises(engines.EngineUnavailable, match=r"(?s)vllm.*extra.*rollout_engine hf"):
        whitebox.prepare("tiny", {"rollout_engine": "vllm", "run_dir": str(tmp_path / "x")})
    assert not (tmp_path / "x").exists()


def test_rollout_engine_is_checked():
    with pytest.raises(ConfigError, match="rollout_engine"):
        whitebox.prepare("tiny", {"rollout_engine": "sglang"})


def test_a_vllm_engine_fits_the_longest_evaluation_prompt_with_its_answer(tmp_path, student_tok):
    """The engine also decodes the student's accuracies, whose prompts are not cut to max_prompt_length."""
    _, tok = student_tok
    prep = whitebox.prepare("tiny", {"eval_size": 40, "eval_max_new_tokens": 50})
    longest = max(
        len(tok.apply_chat_template(m, add_generation_prompt=True, return_dict=True)["input_ids"])
        for m in prep.eval_messages
    )
    assert prep.eval_prompt_tokens == longest > 0
    cfg = prep.cfg
    fits = wb_job.training_arguments(cfg, tmp_path, eval_prompt_tokens=cfg.max_prompt_length + 300)
    assert fits.vllm_max_model_len == cfg.max_prompt_length + 300 + 50
    rollouts_only = wb_job.training_arguments(cfg, tmp_path)
    assert rollouts_only.vllm_max_model_len == cfg.max_prompt_length + cfg.rollout_max_new_tokens


def test_a_vllm_engine_fits_an_episode_at_its_longest(tmp_path):
    """With an environment the engine's context holds the longest prompt and a whole episode: the episode's
    token budget, else max_turns turns; evaluation episodes likewise, of the evaluation's budget per turn."""
    from opdkit.jobs.whitebox.config import WhiteboxConfig

    over = dict(rollout_engine="vllm", environment="calculator", max_prompt_length=96, max_turns=3)
    cfg = WhiteboxConfig(**over, rollout_max_new_tokens=40, eval_max_new_tokens=70)
    assert wb_job.training_arguments(cfg, tmp_path).vllm_max_model_len == 96 + 3 * 40
    assert wb_job.training_arguments(cfg, tmp_path, eval_prompt_tokens=90).vllm_max_model_len == 90 + 3 * 70
    capped = WhiteboxConfig(**over, rollout_max_new_tokens=40, episode_max_tokens=100)
    assert wb_job.training_arguments(capped, tmp_path, eval_prompt_tokens=120).vllm_max_model_len == 220


def test_greedy_settings_decode_greedily_in_the_hf_engine(student_tok):
    """Temperature 0 means greedy in both engines: the HF engine takes the argmax whatever the seed, and
    leaves the global RNG alone (evaluation while training must not reseed it)."""
    model, tok = student_tok
    ids, mask = microbatches.concat_prompts(micro_batches(tok), tok.pad_token_id)
    greedy = engines.SamplingSettings(12, 0.0, 1.0, [tok.eos_token_id], tok.pad_token_id)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a, b = (engines.HFEngine().sample(model, ids, mask, greedy, seed=s) for s in (1, 2))
    assert torch.equal(torch.get_rng_state(), state), "greedy decoding must not reseed the global RNG"
    want = hf_greedy(model, tok, ids, mask)
    assert torch.equal(a.input_ids_BT, want.input_ids_BT) and torch.equal(b.input_ids_BT, want.input_ids_BT)
