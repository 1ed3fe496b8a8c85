"""antidistill's sweep (opdkit.jobs.antidistill.sweep): the points parsed from the config, each run once and
never two in one folder; the gradient checked against the proxy before anything is written; the
derived gradients (answer-token, confident) computed once before the processes start, saved, apart from the
completion gradient; `grad_scale` on every gradient the sweep steers by; the students' held-out loss
skipped without the gradient's traces."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny_model

from opdkit.ads import gradfile, gradient
from opdkit.config import ConfigError, load_config
from opdkit.data import prompts
from opdkit.jobs import antidistill
from opdkit.jobs.antidistill import sweep
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.run import lifecycle
from opdkit.run.folders import RunDir
from opdkit.sft import student as sft_student


def test_job_checks_the_gradient_before_writing_anything(grads_run, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(gradfile.GradsMismatch):
        antidistill.run(
            "tiny", {"grads_run": str(grads_run), "proxy_model": "tiny:teacher", "run_dir": str(run_dir)}
        )
    assert not run_dir.exists()
    with pytest.raises(FileNotFoundError, match="grads.safetensors"):
        antidistill.prepare("tiny", {"grads_run": str(tmp_path)})
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in (gradfile.GRADS_FILE, gradfile.META_FILE):
        (bare / name).write_bytes((grads_run / name).read_bytes())
    with pytest.raises(ConfigError, match="answer_lams needs the traces"):
        antidistill.prepare("tiny", {"grads_run": str(bare)})
    antidistill.prepare("tiny", {"grads_run": str(bare), "answer_lams": []})


def test_sweeps_parse_and_points_run_once():
    cfg = load_config(
        AntidistillConfig,
        "tiny",
        {
            "lams": "0, 0.05,0.1",
            "answer_lams": [0, 0.02],
            "confident_lams": [0.03],
            "ads_temperatures": [1.0],
            "temperatures": [1.0, 1.5],
        },
    )
    assert cfg.lams == [0.0, 0.05, 0.1]
    points = sweep.sweep_points(cfg)
    assert [p.name for p in points] == [
        "temperature-lam0-tau1",
        "ads-lam0.05-tau1",
        "ads-lam0.1-tau1",
        "ads-answer-lam0.02-tau1",
        "ads-confident-lam0.03-tau1",
        "temperature-lam0-tau1.5",
    ]
    assert [p.gradient for p in points] == [None, "completion", "completion", "answer", "confident", None]
    assert sweep.derived_gradients(cfg) == ["answer", "confident"]
    with pytest.raises(ConfigError, match="list of numbers"):
        load_config(AntidistillConfig, "tiny", {"lams": "a,b"})
    with pytest.raises(ConfigError, match="all empty"):
        AntidistillConfig(lams=[], answer_lams=[], temperatures=[])
    with pytest.raises(ConfigError, match="grad_tokens=answer already makes lams' gradient a variant"):
        load_config(AntidistillConfig, "tiny", {"confident_lams": [0.05], "grad_tokens": "answer"})


def test_points_sharing_a_folder_name_are_refused_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"ads-lam0\.1-tau1: λ=0\.1 τ=1\.0, λ=0\.1000001 τ=1\.0"):
        antidistill.run("tiny", {"lams": [0.1, 0.1000001], "run_dir": str(run_dir)})
    assert not run_dir.exists()
    close = antidistill.sweep_points(load_config(AntidistillConfig, "tiny", {"lams": [0.1, 0.100001]}))
    assert len({p.name for p in close}) == len(close)  # six digits apart: two folders


def test_derived_gradients_are_computed_once_before_the_processes_start(grads_run, tmp_path, monkeypatch):
    computed, launched = [], []
    real_grad, real_launch = sweep.mean_completion_grad, lifecycle.launch

    def counting_grad(*args, **kwargs):
        computed.append(1)
        return real_grad(*args, **kwargs)

    def checking_launch(fn, args, n, run_path):
        launched.append((run_path / "grads_answer" / gradfile.GRADS_FILE).is_file())
        return real_launch(fn, args, n, run_path)

    monkeypatch.setattr(sweep, "mean_completion_grad", counting_grad)
    monkeypatch.setattr(lifecycle, "launch", checking_launch)
    over = {
        "subset_size": 8,
        "eval_size": 4,
        "sft_max_steps": 1,
        "sft_batch_size": 8,
        "sft_micro_batch_size": 4,
        "lams": [],
        "temperatures": [],
        "answer_lams": [0.1],
        "grads_run": str(grads_run),
        "run_dir": str(tmp_path / "run"),
    }
    summary = antidistill.run("tiny", over).read_summary()
    assert summary["status"] == "done" and set(summary["grad_norms"]) == {"completion", "answer"}
    assert launched == [True]  # on disk before any sweep process starts
    assert computed == [1]  # and the sweep's process loaded it instead of computing it again


def test_answer_gradient_needs_a_trace_with_an_answer(grads_run, proxy, tok, monkeypatch):
    cfg = load_config(AntidistillConfig, "tiny", {"grads_run": str(grads_run)})
    monkeypatch.setattr(sweep.tokenkinds, "answer_rows", lambda *args: [])  # as if no answer anywhere
    with pytest.raises(ConfigError, match="no trace of the gradient run keeps a token of kind answer"):
        sweep.derived_gradient(cfg, "answer", proxy, None, tok, grads_run, None)


def test_answer_gradient_is_saved_and_differs_from_the_completion_gradient(small_run, g, tok, proxy):
    answer = gradfile.load_grads(small_run.path / "grads_answer", proxy, tok)
    meta = gradfile.read_meta(small_run.path / "grads_answer")
    assert meta["tokens"] == "answer" and meta["normalization"] == "trace"
    cos = sum((answer[k] * g[k]).sum() for k in g) / (gradient.global_norm(answer) * gradient.global_norm(g))
    assert 0.1 < float(cos) < 0.95  # related (the answer is part of the completion), not the same
    assert set(small_run.read_summary()["grad_norms"]) == {"completion", "answer"}


def test_grad_scale_scales_every_gradient_the_sweep_uses(grads_run):
    over = {"grads_run": str(grads_run), "answer_lams": [0.01], "subset_size": 4, "eval_size": 4}
    a, b = (
        sweep.load_steering(p.cfg, p.proxy_tokenizer, p.student_tokenizer, grads_run, torch.device("cpu"))[0]
        for p in (
            antidistill.prepare("tiny", over),
            antidistill.prepare("tiny", {**over, "grad_scale": 0.125}),
        )
    )
    for kind in ("completion", "answer"):
        for name, grad in a.grads[kind].items():
            torch.testing.assert_close(b.grads[kind][name], grad / 8, rtol=0, atol=0)
    assert b.grad_norms()["completion"] == pytest.approx(a.grad_norms()["completion"] / 8)


def test_holdout_loss_is_skipped_without_the_gradients_traces(tmp_path, tok):
    cfg = load_config(AntidistillConfig, "tiny")
    assert sweep.holdout_rows(tmp_path, tok, cfg) == []
    assert sft_student.holdout_loss(tiny_model("tiny:student"), [], tok.pad_token_id, 8) is None


def test_a_gradient_computed_here_reads_this_run_s_prompts(dapo_parquet, tmp_path, monkeypatch):
    """grads_run empty: the savegrad run 04 starts, and the holdout 04 checks its training prompts against,
    read 04's file, split, seed and prompt settings, not the preset's (savegrad full's file is not here)."""
    from opdkit.jobs import savegrad
    from opdkit.jobs.savegrad.config import SaveGradConfig

    over = {
        "dataset_path": str(dapo_parquet),
        "subset_size": 6,
        "eval_dataset_path": str(dapo_parquet),
        "eval_dataset_split": "train",
        "eval_size": 3,
        "grads_mode": "full",
        "seed": 7,
        "max_prompt_length": 10**5,
        "system_prompt": "Be brief.",
        "grad_tokens": "confident",
        "grad_entropy": 0.5,
    }
    preset = load_config(SaveGradConfig, "full")
    assert preset.dataset_path != str(dapo_parquet) and preset.seed != 7
    prep = antidistill.prepare("tiny", over)
    holdout = savegrad.holdout_messages(sweep.grads_config(prep.cfg))
    assert len(holdout) == 4  # the tail 30 % of the 12 rows in the seed-7 shuffle
    texts = {m[-1]["content"] for m in prompts.load_prompts(str(dapo_parquet), "train", -1, 7)["messages"]}
    assert {m[-1]["content"] for m in holdout} <= texts
    assert all(m[0] == {"role": "system", "content": "Be brief."} for m in holdout)
    assert prep.gradient_holdout == (
        f"checked: none of the training prompts is among the 4 of savegrad --mode full on {dapo_parquet}"
    )

    started = {}

    def fake_savegrad_run(mode, overrides):
        started.update(mode=mode, cfg=load_config(SaveGradConfig, mode, overrides))
        return RunDir.create(started["cfg"], job="savegrad", mode=mode)

    monkeypatch.setattr(savegrad, "run", fake_savegrad_run)
    run = RunDir.create(dataclasses.replace(prep.cfg, run_dir=str(tmp_path / "run")), "antidistill", "tiny")
    sweep.ensure_grads(prep.cfg, run)
    cfg = started["cfg"]
    assert started["mode"] == "full"
    assert (cfg.dataset_path, cfg.dataset_split, cfg.seed) == (str(dapo_parquet), "train", 7)
    assert (cfg.max_prompt_length, cfg.system_prompt, cfg.enable_thinking) == (10**5, "Be brief.", False)
    assert (cfg.holdout_fraction, cfg.subset_size) == (preset.holdout_fraction, preset.subset_size)
    assert (cfg.grad_tokens, cfg.grad_entropy) == ("confident", 0.5)  # the variant 04's parameters cell picks
    assert savegrad.holdout_messages(cfg) == holdout


def test_a_given_gradient_must_be_the_variant_asked_for(grads_run, tmp_path):
    """grads_run holds the whole completion gradient (grad_tokens all): asking for another variant stops in
    one line; a file from before the setting existed counts as all; a confident one must match the entropy."""
    with pytest.raises(ConfigError, match="holds the gradient of grad_tokens all, but this run asks"):
        antidistill.prepare("tiny", {"grads_run": str(grads_run), "grad_tokens": "confident"})
    cfg = load_config(AntidistillConfig, "tiny", {"grads_run": "x", "grad_tokens": "confident"})
    sweep.check_variant(cfg, {"grad_tokens": "confident", "grad_entropy": 0.3})
    with pytest.raises(ConfigError, match="grad_entropy 0.5, but this run asks for grad_tokens confident"):
        sweep.check_variant(cfg, {"grad_tokens": "confident", "grad_entropy": 0.5})
    sweep.check_variant(dataclasses.replace(cfg, grad_tokens="all"), {})  # no grad_tokens: all
    with pytest.raises(ConfigError, match="grad_tokens='most' is not one of"):
        antidistill.prepare("tiny", {"grad_tokens": "most"})


def test_a_gradient_preset_for_the_tiny_stream_cannot_hold_out_part_of_a_file(dapo_parquet):
    over = {"dataset_path": str(dapo_parquet), "subset_size": 6, "grads_mode": "tiny"}
    over.update(eval_dataset_path=str(dapo_parquet), eval_dataset_split="train", eval_size=3)
    with pytest.raises(ConfigError, match="grads_mode='tiny' holds out the whole of dataset_path"):
        antidistill.prepare("tiny", over)
