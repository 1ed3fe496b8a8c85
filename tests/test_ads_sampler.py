"""04's options for reproducing the ADS reference: top-k after the ADS term and the temperature (before
top-p), the gradient scale (the reference's saved gradient is 1/8 of the mean), the students' SFT seed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from opdkit import models, tiny
from opdkit.ads import gradfile
from opdkit.ads.direction import FiniteDifference
from opdkit.ads.sampler import ads_processors
from opdkit.config import load_config
from opdkit.jobs import antidistill, savegrad
from opdkit.jobs.antidistill import steering, students
from opdkit.jobs.antidistill.config import AntidistillConfig
from opdkit.rollout import sampling


@pytest.fixture(scope="module")
def grads_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("opts") / "grads"
    savegrad.run("tiny", {"run_dir": str(path), "subset_size": 8})
    return path


@pytest.fixture(scope="module")
def tok():
    return models.load_tokenizer("tiny:teacher")


def test_top_k_comes_after_the_ads_term_and_temperature_before_top_p(grads_dir, tok):
    proxy = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")).eval()
    g = gradfile.load_grads(grads_dir, proxy, tok)
    ids, mask = sampling.encode_prompts(tok, [[{"role": "user", "content": "12+34="}]] * 3)
    delta = FiniteDifference(proxy, g).start(ids, mask)
    torch.manual_seed(0)
    scores = torch.randn(3, delta.shape[-1]) * 3
    got = ads_processors(FiniteDifference(proxy, g), 0.2, mask, temperature=0.7, top_p=0.8, top_k=5)(
        ids, scores
    )
    want = (scores + 0.2 * delta) / 0.7
    keep = torch.isfinite(got)
    torch.testing.assert_close(got[keep], want[keep])
    for b in range(3):
        top5 = set(want[b].topk(5).indices.tolist())
        kept = set(keep[b].nonzero().flatten().tolist())
        assert kept <= top5 and kept  # top-k first: nothing outside the 5 best of z + λΔ over τ
        p = want[b, sorted(top5)].softmax(-1).sort(descending=True).values  # renormalised over the top 5
        n = len(kept)
        assert p[: n - 1].sum() < 0.8 <= p[:n].sum() + 1e-6  # then the nucleus of what top-k left


def test_top_k_zero_is_off_and_warpers_keep_generate_order():
    names = [type(w).__name__ for w in sampling.warpers(0.7, 0.9, 50)]
    assert names == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert [type(w).__name__ for w in sampling.warpers(0.7, 0.9)] == [
        "TemperatureLogitsWarper",
        "TopPLogitsWarper",
    ]


def test_grad_scale_scales_every_gradient_the_sweep_uses(grads_dir):
    over = {"grads_run": str(grads_dir), "answer_lams": [0.01], "subset_size": 4, "eval_size": 4}
    plain = antidistill.prepare("tiny", over)
    scaled = antidistill.prepare("tiny", {**over, "grad_scale": 0.125})
    a = steering.load_models(plain.cfg, plain, grads_dir, torch.device("cpu"))
    b = steering.load_models(scaled.cfg, scaled, grads_dir, torch.device("cpu"))
    for kind in ("completion", "answer"):
        for name, grad in a.grads[kind].items():
            torch.testing.assert_close(b.grads[kind][name], grad / 8, rtol=0, atol=0)
    assert b.grad_norms()["completion"] == pytest.approx(a.grad_norms()["completion"] / 8)


def test_sft_seed_follows_the_repeats():
    base = load_config(AntidistillConfig, "tiny", {"seed": 42})
    assert [students.sft_seed(base, s) for s in (42, 43)] == [42, 43]
    fixed = load_config(AntidistillConfig, "tiny", {"seed": 42, "sft_seed": 69})
    assert [students.sft_seed(fixed, s) for s in (42, 43)] == [69, 70]
