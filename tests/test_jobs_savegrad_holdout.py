"""01 with proxy_tokens=teacher: the proxy's gradient is taken on the teacher's own token ids (its chat
template's prompt, then exactly the tokens it generated), as the ADS reference takes it and as ADS later
feeds the proxy; checked against the teacher's greedy `generate` and a plain autograd gradient."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from opdkit import models, tiny
from opdkit.config import ConfigError, load_config
from opdkit.data import prompts, traces
from opdkit.data.labels import IGNORE
from opdkit.jobs import savegrad
from opdkit.jobs.savegrad.config import SaveGradConfig


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher-tokens") / "run"
    return savegrad.run(
        "tiny",
        {"run_dir": str(path), "subset_size": 6, "proxy_tokens": "teacher", "trace_max_new_tokens": 24},
    )


def test_rows_are_the_teachers_own_tokens(teacher_run):
    tok = models.load_tokenizer("tiny:teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).eval()
    rows = list(traces.load_traces(teacher_run))
    assert any(r["truncated"] for r in rows) and not all(r["truncated"] for r in rows)
    for r in rows:
        prompt = prompts.prompt_ids(tok, r["messages"][:-1])
        assert r["input_ids"][: len(prompt)] == prompt and all(
            t == IGNORE for t in r["labels"][: len(prompt)]
        )
        completion = r["input_ids"][len(prompt) :]
        assert r["labels"][len(prompt) :] == completion
        with torch.no_grad():
            out = teacher.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=models.eos_ids(tok, teacher),
                pad_token_id=tok.pad_token_id,
            )
        assert completion == out[0, len(prompt) :].tolist()  # including the stop token, when it stopped
        assert (completion[-1] in models.eos_ids(tok, teacher)) is not r["truncated"]
    assert json.loads((teacher_run.path / "grads.json").read_text())["proxy_tokens"] == "teacher"


def test_gradient_is_the_mean_of_each_traces_mean_token_nll_gradient(teacher_run):
    proxy = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student"), dtype=torch.float32)
    rows = list(traces.load_traces(teacher_run))
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        labels = torch.tensor([r["labels"]])
        (proxy(input_ids=ids, labels=labels).loss / len(rows)).backward()  # HF shifts the labels itself
    saved = load_file(str(teacher_run.path / "grads.safetensors"))
    for name, p in proxy.named_parameters():
        torch.testing.assert_close(saved[name], p.grad, rtol=1e-4, atol=1e-7)


def test_supplied_traces_cannot_give_teacher_tokens(tmp_path):
    with pytest.raises(ConfigError, match="proxy_tokens=teacher"):
        savegrad.prepare("tiny", {"traces_path": str(tmp_path / "t.jsonl"), "proxy_tokens": "teacher"})


def test_ads_paper_takes_the_gradient_on_teacher_tokens():
    assert load_config(SaveGradConfig, "ads-paper").proxy_tokens == "teacher"
    assert load_config(SaveGradConfig, "tiny").proxy_tokens == "proxy"
