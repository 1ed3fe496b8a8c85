"""Presets that reproduce a source say where they differ from it: every full and ads-paper preset opens with
a "differences from the source" block, and each preset key it names (in backticks) is a field of its job."""

from __future__ import annotations

import re
from dataclasses import asdict

import pytest
from helpers import CONFIGS

from opdkit import config
from opdkit.config import ConfigError, load_config
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.jobs.savegrad.config import SaveGradConfig
from opdkit.jobs.whitebox.config import WhiteboxConfig

SOURCED = [
    (job, mode)
    for job, cls in CONFIGS.items()
    for mode in config.available_modes(cls)
    if mode in ("full", "ads-paper")
]


def opening_comments(job: str, mode: str) -> list[str]:
    lines = (config.PARAMS_DIR / job / f"{mode}.yaml").read_text().splitlines()
    block = []
    for line in lines:
        if not line.startswith("#"):
            break
        block.append(line.lstrip("# ").rstrip())
    return block


def test_every_full_and_ads_paper_preset_is_covered():
    assert len(SOURCED) == 6  # 01 full, ads-paper; 02 full; 03 full; 04 full, ads-paper


@pytest.mark.parametrize("job,mode", SOURCED)
def test_differences_block_names_only_real_keys(job, mode):
    block = opening_comments(job, mode)
    starts = [i for i, line in enumerate(block) if line.lower().startswith("differences from the source")]
    assert starts, f"{job}/{mode}.yaml does not open with a 'differences from the source' block"
    named = re.findall(r"`([^`]+)`", "\n".join(block[starts[0] :]))
    assert named, "the block names no preset key"
    fields = set(config.field_names(CONFIGS[job]))
    assert set(named) <= fields, f"not fields of {job}: {sorted(set(named) - fields)}"
    preset = config.load_preset(CONFIGS[job], mode)
    missing = [k for k in named if k not in preset]
    assert not missing, f"named but not set in the preset: {missing}"


def test_ads_paper_reproduces_the_reference_grid_and_sampling():
    """The reference's grid.py, as it writes its lines (%.2e), and its sampling and SFT seed."""
    import numpy as np

    cfg = load_config(AntidistillConfig, "ads-paper")
    assert cfg.lams == [float(f"{b * 1e-2:.2e}") for b in np.linspace(0, 15, 20)]
    assert cfg.temperatures == [float(f"{t:.2e}") for t in np.linspace(1.0, 2.0, 20)]
    assert (cfg.ads_temperatures, cfg.eps, cfg.trace_top_k, cfg.trace_top_p) == ([0.9, 1.0], 1e-2, 50, 0.95)
    assert (cfg.seed, cfg.sft_seed, cfg.grad_scale) == (42, 69, 1 / 8)
    assert "platinum" in cfg.eval_dataset_path and cfg.eval_size == -1
    from opdkit.jobs.antidistill.sweep import sweep_points

    assert len(sweep_points(cfg)) == 59  # the reference's 59 runs
    holdout = load_config(SaveGradConfig, "ads-paper")
    assert cfg.subset_size == 7473 - round(7473 * holdout.holdout_fraction)  # GSM8K train's 70%, 01's 30%


def test_antidistill_refuses_eval_size_zero():
    with pytest.raises(ConfigError, match="eval_size=0"):
        load_config(AntidistillConfig, "tiny", {"eval_size": 0})


def test_the_staleness_presets_differ_in_the_divergence_alone():
    """Forward against reverse KL under staleness (docs/async.md): the same arms at the same seeds."""
    fkl, rkl = (asdict(load_config(WhiteboxConfig, f"tiny-async-{d}-seeds")) for d in ("fkl", "rkl"))
    assert (fkl.pop("beta"), rkl.pop("beta")) == (0.0, 1.0) and fkl == rkl
    assert fkl["ahead_arms"] == "4,4t,8,8t" and fkl["repeats"] == 3
    assert [(a.ahead, a.correction) for a in load_config(WhiteboxConfig, "tiny-async-fkl-seeds").arms()] == [
        (4, "none"),
        (4, "truncated"),
        (8, "none"),
        (8, "truncated"),
    ]
