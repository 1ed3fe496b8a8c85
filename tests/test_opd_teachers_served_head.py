"""The head loaded alone equals the full model's head: tied (the shipped tiny teacher), untied, sharded;
only the head's file is opened; the final norm is recognised where it is a plain RMSNorm."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.models import small_qwen3
from opdkit.opd.teachers.served import head as head_mod
from opdkit.opd.teachers.served.head import load_head


def test_the_tied_tiny_teacher_head_is_its_embedding():
    model = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher"))
    h = load_head("tiny:teacher")
    assert model.config.tie_word_embeddings and h.source.endswith("::model.embed_tokens.weight")
    assert torch.equal(h.weight_VH, model.get_output_embeddings().weight)
    assert torch.equal(h.norm_weight_H, model.model.norm.weight)
    assert h.hidden_size == model.config.hidden_size and h.rows == model.config.vocab_size


@pytest.mark.parametrize("tied", [True, False])
def test_a_sharded_checkpoint_reads_only_the_heads_shard(tmp_path, monkeypatch, tied):
    model = small_qwen3(64, 3, 120, seed=3, tie_word_embeddings=tied)
    if not tied:  # an untied head of its own, unlike the embedding
        with torch.no_grad():
            model.lm_head.weight.normal_()
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / head_mod.INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 2  # really sharded
    opened = []
    real = head_mod._CheckpointFiles.tensor

    def spy(self, key):
        opened.append(self.file_of(key))
        return real(self, key)

    monkeypatch.setattr(head_mod._CheckpointFiles, "tensor", spy)
    h = load_head(str(tmp_path), dtype=torch.bfloat16)
    key = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert h.source == f"{index[key]}::{key}"
    assert opened == [index[key], index["model.norm.weight"]]
    assert h.weight_VH.dtype == torch.bfloat16
    assert torch.equal(h.weight_VH, model.get_output_embeddings().weight.detach().to(torch.bfloat16))


def test_a_folder_without_safetensors_says_how_to_fix_it(tmp_path):
    small_qwen3(64, 1, 50, seed=0).config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safe_serialization"):
        load_head(str(tmp_path))


def test_a_norm_that_is_not_weight_times_x_over_rms_gets_no_state_check():
    class OffsetNorm(torch.nn.Module):  # Gemma's form: (1 + w) * x / rms(x)
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))

    w = torch.rand(8) + 0.5
    assert not head_mod._is_plain_rms_norm(OffsetNorm(), w)
    rms = small_qwen3(64, 1, 50, seed=0).model.norm
    assert head_mod._is_plain_rms_norm(rms, torch.rand(64) + 0.5)
