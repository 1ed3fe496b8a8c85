"""The recipe of the tiny teacher on the byte-level BPE tokenizer (opdkit.build.bpe_teacher)."""

from __future__ import annotations

from transformers import AutoModelForCausalLM

from opdkit.build.bpe_teacher import build_bpe_teacher
from opdkit.tiny.bpe import VOCAB_SIZE


def test_the_recipe_runs_a_few_steps(tmp_path):
    rec = build_bpe_teacher(tmp_path, steps=3, eval_every=2)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.vocab_size == VOCAB_SIZE
    assert set(rec) >= {"teacher_heldout_accuracy", "build_seconds"} and (tmp_path / "recipe.json").exists()
