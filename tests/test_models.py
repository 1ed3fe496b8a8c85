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


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2", "llama"])
def test_a_tokenizer_read_from_its_config_fields_equals_autotokenizers_own(
    tmp_path, qwen3_tokenizer_dir, model_type
):
    """`_read_tokenizer` hands AutoTokenizer the config.json fields it reads (`_ConfigFields`) instead of
    letting it build the model's config (a llama config imports its model's modules: 0.5 s of a dry run);
    the tokenizer is AutoTokenizer's own without them: its class, vocabulary, special tokens, chat template
    and the ids of a templated chat. The real Qwen3 files under each model type of the presets' models
    (04 ads-paper: qwen2 and llama), and the tiny world's byte-level BPE."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from opdkit import tiny

    folder = tmp_path / "model"
    shutil.copytree(qwen3_tokenizer_dir, folder)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 151936}))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    for path in (str(folder), tiny.resolve("tiny:teacher-bpe")):
        assert models.config_fields(path) is not None  # the fast path is the one taken
        ours, theirs = (
            models._read_tokenizer(path, path),
            AutoTokenizer.from_pretrained(path, padding_side="left"),
        )
        if theirs.pad_token is None:
            theirs.pad_token = theirs.eos_token
        assert type(ours) is type(theirs)
        assert ours.get_vocab() == theirs.get_vocab() and ours.chat_template == theirs.chat_template
        assert ours.special_tokens_map == theirs.special_tokens_map and ours.padding_side == "left"
        texts = [
            t.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for t in (ours, theirs)
        ]
        ids = [t(text)["input_ids"] for t, text in zip((ours, theirs), texts)]
        assert texts[0] == texts[1] and ids[0] == ids[1] and len(ids[0]) > 10


def test_config_fields_leave_autotokenizer_to_the_config_where_the_tokenizer_names_no_class(tmp_path):
    """No class in tokenizer_config.json, remote code (auto_map), or no model_type: AutoTokenizer picks the
    class from the model's config object, so it builds it itself."""
    import json
    import shutil

    from opdkit import tiny

    folder = tmp_path / "model"
    shutil.copytree(tiny.resolve("tiny:student"), folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert models.config_fields(str(folder)).model_type == "qwen3"
    for changed in (
        {k: v for k, v in tok_config.items() if k != "tokenizer_class"},
        {**tok_config, "auto_map": {}},
    ):
        (folder / "tokenizer_config.json").write_text(json.dumps(changed))
        assert models.config_fields(str(folder)) is None
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "config.json").write_text(json.dumps({"vocab_size": 10}))
    assert (
        models.config_fields(str(folder)) is None
        and models.config_fields(tiny.resolve("tiny:tokenizer")) is None
    )


def test_loading_a_llama_models_tokenizer_does_not_build_its_config():
    """The saving: with the config's fields handed over, transformers' llama configuration module (which
    imports its activations, kernels and model loading) is not imported by loading the tokenizer."""
    import subprocess
    import sys

    code = (
        "import json, shutil, sys, tempfile; from opdkit import models, tiny; d = tempfile.mkdtemp(); "
        "shutil.copytree(tiny.resolve('tiny:student'), d, dirs_exist_ok=True); "
        "open(d + '/config.json', 'w').write(json.dumps({'model_type': 'llama'})); models.load_tokenizer(d); "
        "print('transformers.models.llama.configuration_llama' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
