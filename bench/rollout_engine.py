"""P5: rollout completion tokens/s of the vLLM engine against the kit's own HF loop, and the tiny OPD
optimizer step time with each engine.

    # runs its workers with .venv-vllm/bin/python (make vllm-env)
    python -m bench.run --only P5 --reps 5

Rollout: both sides get the same random 42M-parameter Qwen3 stand-in (float32, hidden 512, 8 layers,
vocabulary 32,768, saved as a Hugging Face folder because vLLM loads from one) and the same 64 random
prompts of 24-40 tokens, and sample 256 new tokens at temperature 1 through `opdkit.rollout.engines` exactly
as the trainer does: `engine.sync(model)` then one `engine.sample(...)` call for all prompts. Random
weights almost never emit the EOS, so the work is ~64 x 256 tokens on both sides. The clock covers the
sync and the sample, after a 4-token warm-up; the vLLM engine's start is reported beside it (`start_s`),
not in the figure: it is paid once per run. Step: the tiny world's whitebox (batch 64, 40 new
tokens) for a few optimizer steps with `rollout_engine` set to the side; the median step time after the
first (which builds the engine) from metrics.jsonl's clock is reported in the setup. Both sides run in
the vLLM venv, so torch and transformers are the same.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch

from opdkit.models import small_qwen3

SIDES = ("vllm", "hf")
BASELINE = "opdkit's own KV-cached HF decoding loop (opdkit.rollout.sampling.sample, rollout_engine hf)"


def default_params(quick: bool = False) -> dict[str, Any]:
    if quick:
        return dict(
            hidden=64,
            layers=2,
            vocab=512,
            prompts=4,
            min_prompt=8,
            max_prompt=12,
            new_tokens=8,
            seed=0,
            opd_steps=0,
            memory=0.02,
        )
    return dict(
        hidden=512,
        layers=8,
        vocab=32_768,
        prompts=64,
        min_prompt=24,
        max_prompt=40,
        new_tokens=256,
        seed=0,
        opd_steps=6,
        memory=0.05,
    )


def standin(p: dict, folder: str) -> torch.nn.Module:
    model = small_qwen3(
        p["hidden"],
        p["layers"],
        p["vocab"],
        p["seed"],
        max_position_embeddings=1024,
        eos_token_id=p["vocab"] - 1,
    ).eval()
    model.save_pretrained(folder)
    return model


def prompts(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    from opdkit.rollout import sampling

    g = torch.Generator().manual_seed(p["seed"] + 1)
    lengths = torch.randint(p["min_prompt"], p["max_prompt"] + 1, (p["prompts"],), generator=g).tolist()
    ids = [torch.randint(1, p["vocab"] - 1, (n,), generator=g).tolist() for n in lengths]
    return sampling.left_pad(ids, 0)


def rollout_rate(side: str, p: dict) -> dict[str, Any]:
    from opdkit.rollout import engines

    with tempfile.TemporaryDirectory() as folder:
        model = standin(p, folder)
        ids, mask = prompts(p)
        settings = engines.SamplingSettings(p["new_tokens"], 1.0, 1.0, [p["vocab"] - 1], 0)
        t0 = time.perf_counter()
        if side == "vllm":
            engine = engines.make_engine(
                "vllm",
                model_path=folder,
                gpu_memory_utilization=p["memory"],
                max_model_len=p["max_prompt"] + p["new_tokens"] + 8,
            )
            engine.sync(model)
        else:
            engine = engines.make_engine("hf")
        warm = engines.SamplingSettings(4, 1.0, 1.0, [p["vocab"] - 1], 0)
        engine.sample(model, ids, mask, warm, seed=p["seed"])
        start_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.sync(model)
        r = engine.sample(model, ids, mask, settings, seed=p["seed"])
        wall = time.perf_counter() - t0
    tokens = int(r.completion_mask_BC.sum())
    return {
        "tokens_per_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "start_s": start_s,
        "params_m": sum(x.numel() for x in model.parameters()) / 1e6,
        "threads": torch.get_num_threads(),
    }


def opd_step_s(side: str, p: dict) -> float | None:
    """Median optimizer-step wall time of tiny whitebox with this engine (the first step, which builds
    the engine, left out)."""
    if not p["opd_steps"]:
        return None
    import statistics

    from opdkit.jobs import whitebox

    with tempfile.TemporaryDirectory() as folder:
        run = whitebox.run(
            "tiny",
            {
                "run_dir": f"{folder}/run",
                "rollout_engine": side,
                "max_steps": p["opd_steps"],
                "eval_size": 0,
                "sample_every": 0,
                "checkpoint_every": 0,
                "vllm_gpu_memory_utilization": p["memory"],
            },
        )
        rows = run.read_jsonl()
    return statistics.median(r["completion_tokens"] / r["tokens_per_s"] for r in rows[1:])


def measure(side: str, p: dict) -> dict[str, Any]:
    out = rollout_rate(side, p)
    out["opd_step_s"] = opd_step_s(side, p)
    return out
