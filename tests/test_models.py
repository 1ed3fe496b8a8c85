"""Completions end at the tokenizer's EOS or any stop token of the model's generation config, wherever a
completion ends: greedy evaluation and the white-box trainer's rollouts (01 and 04 are tested in their own
files). The stand-in is a tiny random Qwen3 with the real Qwen3 tokenizer (EOS <|im_end|>) and Qwen3's
generation config, which also stops at <|endoftext|>; a hook on its head makes it write "Hi",
<|endoftext|>, then " there" until <|im_end|>. Also: a proxy (or teacher) must share the teacher's
tokenizer."""

from __future__ import annotations

import pytest
import torch

from opdkit import models
from opdkit.config import ConfigError
from opdkit.data import prompts
from opdkit.opd.trainer import DistillTrainer, OPDArguments
from opdkit.rollout import greedy as evaluate

QWEN3_STOPS = [151645, 151643]  # Qwen3's generation_config.json: <|im_end|>, <|endoftext|>


class Script:
    """Forces the head's argmax through a fixed token sequence, one per forward call."""

    def __init__(self, tokens: list[int]):
        self.tokens, self.calls = tokens, 0

    def __call__(self, module, inputs, logits):
        token = self.tokens[min(self.calls, len(self.tokens) - 1)]
        self.calls += 1
        out = logits.clone()
        out[..., token] += 1e4
        return out


@pytest.fixture
def standin(qwen3_tokenizer):
    tok = qwen3_tokenizer
    hi, there = tok.encode("Hi")[0], tok.encode(" there")[0]
    model = models.small_qwen3(
        16,
        1,
        151936,
        0,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=151643,
    ).eval()
    model.generation_config.eos_token_id = QWEN3_STOPS
    script = Script([hi, tok.convert_tokens_to_ids("<|endoftext|>"), there, there, there, tok.eos_token_id])
    model.lm_head.register_forward_hook(script)
    return model, tok, script, hi


def test_qwen3_stop_list(standin):
    model, tok, _, _ = standin
    assert tok.eos_token_id == 151645 and models.eos_ids(tok, model) == sorted(QWEN3_STOPS)
    wrapped = torch.nn.Module()
    wrapped.module = model  # as DDP holds the model
    assert models.eos_ids(tok, wrapped) == sorted(QWEN3_STOPS) and models.eos_ids(tok) == [151645]


def test_greedy_evaluation_stops_at_endoftext(standin):
    model, tok, script, hi = standin
    comps = evaluate.greedy_completions(
        model, tok, [[{"role": "user", "content": "Say hi"}]], max_new_tokens=8
    )
    assert comps == [tok.decode([hi])]
    assert script.calls == 2  # nothing was generated after <|endoftext|>


def test_whitebox_rollout_stops_at_endoftext(standin, tmp_path):
    model, tok, _, hi = standin
    args = OPDArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", rollout_max_new_tokens=8)
    trainer = DistillTrainer(
        model=model,
        args=args,
        processing_class=tok,
        teacher_model=model,
        data_collator=prompts.PromptCollator(tok, 64),
    )
    batch = prompts.PromptCollator(tok, 64)(
        [{"messages": [{"role": "user", "content": "Say hi"}], "answer": ""}]
    )
    (out,) = trainer.rollouts.next_step(trainer.model, [batch], step=0)
    assert out.loss_mask_BT[0, -2:].tolist() == [1, 1] and out.loss_mask_BT.sum() == 2
    assert out.input_ids_BT[0, -2:].tolist() == [hi, 151643]
    assert not out.truncated_B.any()


def test_shared_vocab_check(tok, qwen3_tokenizer):
    models.check_shared_vocab(tok, tok)
    with pytest.raises(ConfigError, match="shares the teacher's tokenizer"):
        models.check_shared_vocab(tok, qwen3_tokenizer)


def count_reads(monkeypatch) -> list[str]:
    """The folders `models.load_tokenizer` reads from its files from now on (none loaded before)."""
    reads, read = [], models.AutoTokenizer.from_pretrained
    monkeypatch.setattr(models, "_LOADED", {})
    monkeypatch.setattr(
        models.AutoTokenizer, "from_pretrained", lambda path, **kw: reads.append(path) or read(path, **kw)
    )
    return reads


def test_a_tokenizer_loads_once_per_process_until_its_files_change(tmp_path, monkeypatch):
    """A dry run asks for one tokenizer several times (0.7 s each for Qwen3's): read once; a folder whose
    files changed since (a notebook rebuilding it) is read again."""
    import shutil

    from opdkit import tiny

    folder = tmp_path / "tok"
    shutil.copytree(tiny.resolve("tiny:tokenizer"), folder)
    reads = count_reads(monkeypatch)
    first = models.load_tokenizer(str(folder))
    assert models.load_tokenizer(str(folder)) is first and reads == [str(folder)]
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    again = models.load_tokenizer(str(folder))
    assert again is not first and reads == [str(folder)] * 2
    assert again.get_vocab() == first.get_vocab() and again.padding_side == "left"


def test_folders_holding_the_same_tokenizer_files_share_one_load(tmp_path, monkeypatch):
    """04 full's teacher, proxy and student ship Qwen3's tokenizer: read once. The model's own files do not
    count (another config or weights, the same tokenizer); another tokenizer file, or another model_type
    (which AutoTokenizer falls back on), is read on its own."""
    import json
    import shutil

    from opdkit import tiny

    student, teacher = tiny.resolve("tiny:student"), tiny.resolve("tiny:teacher")
    reads = count_reads(monkeypatch)
    first = models.load_tokenizer(student)
    assert models.load_tokenizer(teacher) is first and reads == [student]  # other weights and config
    other = tmp_path / "other"
    shutil.copytree(student, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert models.load_tokenizer(str(other)) is not first and reads == [student, str(other)]
    bpe = tiny.resolve("tiny:teacher-bpe")
    assert models.load_tokenizer(bpe).get_vocab() != first.get_vocab() and reads[-1] == bpe
