"""opdkit.data.prompts: every source and layout loads to the same prompts; filtering, collation, the
first-prompt check."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from opdkit import tasks
from opdkit.data import prompts
from opdkit.tasks import tiny as task

MATH = tasks.get_task("math")  # the loader with math reference answers (GSM8K's ####, boxed)

GEN_PROMPT = "<|im_start|>assistant\n"  # both test tokenizers' generation prompt (thinking on, for Qwen3)
QWEN3_NO_THINK = "<think>\n\n</think>\n\n"


def _write_parquet(path: Path, columns: dict) -> Path:
    datasets.Dataset.from_dict(columns).to_parquet(str(path))
    return path


@pytest.fixture(scope="module")
def dapo_raw(dapo_parquet: Path) -> datasets.Dataset:
    return datasets.Dataset.from_parquet(str(dapo_parquet))


@pytest.fixture(scope="module")
def dapo_prompts(dapo_parquet: Path) -> datasets.Dataset:
    return MATH.load_prompts(str(dapo_parquet), seed=0)


def _save_jsonl(ds: datasets.Dataset, d: Path) -> Path:
    ds.to_json(str(d / "p.jsonl"))
    return d / "p.jsonl"


def _save_json(ds: datasets.Dataset, d: Path) -> Path:
    (d / "p.json").write_text(json.dumps(ds.to_list()))  # one JSON array of records
    return d / "p.json"


def _save_arrow(ds: datasets.Dataset, d: Path) -> Path:
    ds.save_to_disk(str(d / "saved"))
    shutil.copy(next((d / "saved").glob("*.arrow")), d / "p.arrow")
    return d / "p.arrow"


def _save_disk(ds: datasets.Dataset, d: Path) -> Path:
    ds.save_to_disk(str(d / "folder"))
    return d / "folder"


def _save_parquet_folder(ds: datasets.Dataset, d: Path) -> Path:
    (d / "files").mkdir()
    ds.to_parquet(str(d / "files" / "train-00000.parquet"))
    return d / "files"


def _save_disk_dict(ds: datasets.Dataset, d: Path) -> Path:
    datasets.DatasetDict({"train": ds.select([0]), "test": ds}).save_to_disk(str(d / "dict"))
    return d / "dict"


@pytest.mark.parametrize(
    "save, split",
    [
        (_save_jsonl, "train"),
        (_save_json, "train"),
        (_save_arrow, "train"),
        (_save_disk, "train"),
        (_save_disk_dict, "test"),
        (_save_parquet_folder, "train"),
    ],
    ids=["jsonl", "json", "arrow", "save_to_disk", "save_to_disk_dict", "folder_of_files"],
)
def test_every_format_loads_the_same_prompts(save, split, dapo_raw, dapo_prompts, tmp_path):
    ds = MATH.load_prompts(str(save(dapo_raw, tmp_path)), split=split, seed=0)
    assert ds.column_names == ["messages", "answer"]
    assert ds["messages"] == dapo_prompts["messages"]
    assert ds["answer"] == dapo_prompts["answer"]


def test_dapo_layout(dapo_prompts, dapo_raw):
    assert len(dapo_prompts) == len(dapo_raw) == 12
    by_answer = {r["reward_model"]["ground_truth"] for r in dapo_raw}
    assert set(dapo_prompts["answer"]) == by_answer
    first = dapo_prompts[0]["messages"]
    assert [m["role"] for m in first] == ["user"] and "\\boxed{}" in first[0]["content"]


def test_messages_layout_drops_final_assistant_turn(tmp_path):
    convos = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "It is \\boxed{2}."},
        ],
        [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "No answer known."}],
    ]
    ds = MATH.load_prompts(str(_write_parquet(tmp_path / "m.parquet", {"messages": convos})), seed=0)
    got = {tuple(m["content"] for m in r["messages"]): r["answer"] for r in ds}
    assert got == {("Be brief.", "1+1?"): "2", ("Say hi.",): "hi", ("No answer known.",): ""}


def test_answer_column_wins_over_assistant_turn(tmp_path):
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "long reasoning"}]
    path = _write_parquet(tmp_path / "m.parquet", {"messages": [convo], "answer": ["7"]})
    ds = MATH.load_prompts(str(path))
    assert ds[0] == {"messages": [{"role": "user", "content": "q"}], "answer": "7"}


@pytest.mark.parametrize(
    "columns, answer",
    [
        ({"prompt": ["What is 6*7?"]}, ""),
        ({"question": ["What is 6*7?"], "answer": ["6*7 = <<6*7=42>>42\n#### 42"]}, "42"),  # GSM8K
        ({"problem": ["What is 6*7?"], "solution": ["Multiply: $\\boxed{42}$."]}, "42"),  # MATH
    ],
    ids=["prompt", "gsm8k", "math"],
)
def test_text_layouts_become_one_user_message(columns, answer, tmp_path):
    ds = MATH.load_prompts(str(_write_parquet(tmp_path / "t.parquet", columns)))
    assert ds[0] == {"messages": [{"role": "user", "content": "What is 6*7?"}], "answer": answer}


def test_subset_is_deterministic(dapo_parquet):
    a = MATH.load_prompts(str(dapo_parquet), subset_size=5, seed=1)
    b = MATH.load_prompts(str(dapo_parquet), subset_size=5, seed=1)
    c = MATH.load_prompts(str(dapo_parquet), subset_size=12, seed=2)
    assert len(a) == 5 and a["messages"] == b["messages"] and a["answer"] == b["answer"]
    assert c["answer"][:5] != a["answer"]
    everything = MATH.load_prompts(str(dapo_parquet), subset_size=-1, seed=1)
    assert len(everything) == len(MATH.load_prompts(str(dapo_parquet), subset_size=100, seed=1)) == 12
    assert everything["messages"][:5] == a["messages"]  # the subset is a prefix of the same shuffle


def test_tiny_prompts():
    ds = task.TinyTask().load_prompts("tiny", subset_size=64, seed=42)
    assert len(ds) == 64 and len(task.TinyTask().load_prompts("tiny")) == task.DEFAULT_SIZE
    for row in ds:
        (msg,) = row["messages"]
        a, b = msg["content"].split("+")
        assert msg["role"] == "user" and row["answer"] == str(int(a) + int(b))
    assert ds["messages"] == task.TinyTask().load_prompts("tiny", subset_size=64, seed=42)["messages"]
    assert ds["messages"] != task.TinyTask().load_prompts("tiny", subset_size=64, seed=43)["messages"]
    heldout = [p.prompt for p in task.heldout_problems(64)]
    assert [m[0]["content"] for m in ds["messages"]] != heldout


def test_tiny_seed_is_never_the_heldout_seed():
    assert task.HELDOUT_SEED == 1234
    for seed in (0, 42, task.HELDOUT_SEED, task.HELDOUT_SEED - task.TRAINING_SEED_OFFSET):
        assert task.training_seed(seed) != task.HELDOUT_SEED


@pytest.fixture
def no_hub(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"load_dataset must not be called, got {args} {kwargs}")

    monkeypatch.setattr(datasets, "load_dataset", fail)


@pytest.mark.parametrize(
    "path", ["data/missing.parquet", "missing.jsonl", "./missing", "/nowhere/x", "a/b/c"]
)
def test_missing_local_path_fails_without_the_hub(path, no_hub, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no file or folder at"):
        MATH.load_prompts(path)


def test_hub_name_goes_to_load_dataset(monkeypatch, tmp_path):
    calls = []

    def fake(path, split):
        calls.append((path, split))
        return datasets.Dataset.from_dict({"question": ["q?"], "answer": ["#### 3"]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.chdir(tmp_path)
    ds = MATH.load_prompts("openai/gsm8k", split="test")
    assert calls == [("openai/gsm8k", "test")] and ds["answer"] == ["3"]


def test_no_usable_column_lists_columns(tmp_path, no_hub):
    path = _write_parquet(tmp_path / "x.parquet", {"text": ["a"], "label": [0]})
    with pytest.raises(
        ValueError, match=r"found \['text', 'label'\].*'messages', 'prompt', 'question', 'problem'"
    ):
        MATH.load_prompts(str(path))


def test_empty_sources_fail(tmp_path, dapo_parquet, monkeypatch):
    with pytest.raises(ValueError, match="subset_size=0"):
        MATH.load_prompts(str(dapo_parquet), subset_size=0)
    with pytest.raises(ValueError, match="subset_size=0"):
        task.TinyTask().load_prompts("tiny", subset_size=0)
    empty = datasets.Dataset.from_dict(
        {"prompt": []}, features=datasets.Features({"prompt": datasets.Value("string")})
    )
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.json").write_text("[]\n")
    for name in ("empty.parquet", "empty.jsonl", "empty.json"):
        with pytest.raises(ValueError, match="holds no rows; expected at least one prompt"):
            MATH.load_prompts(str(tmp_path / name))
    monkeypatch.setattr(datasets, "load_dataset", lambda path, split: empty)
    with pytest.raises(ValueError, match="holds no rows; expected at least one prompt"):
        MATH.load_prompts("owner/empty-dataset")


def test_unsupported_file_and_missing_split_fail(tmp_path, dapo_raw):
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match="'.csv' is not one of"):
        MATH.load_prompts(str(tmp_path / "p.csv"))
    with pytest.raises(ValueError, match=r"no split 'validation'; it has \['test', 'train'\]"):
        MATH.load_prompts(str(_save_disk_dict(dapo_raw, tmp_path)), split="validation")


def test_filter_long_prompts(dapo_prompts, qwen3_tokenizer):
    lengths = [len(prompts.prompt_ids(qwen3_tokenizer, m)) for m in dapo_prompts["messages"]]
    assert sorted(lengths)[-1] > 300 > sorted(lengths)[-2]
    with pytest.warns(UserWarning, match="dropped 1 of 12 prompts longer than max_prompt_length=300"):
        kept, n_dropped = prompts.filter_long_prompts(dapo_prompts, qwen3_tokenizer, 300)
    assert n_dropped == 1 and len(kept) == 11
    assert kept["messages"] == [m for m, n in zip(dapo_prompts["messages"], lengths) if n <= 300]


@pytest.mark.parametrize("thinking", [False, True])
def test_prompt_lengths_in_chunks_are_the_lengths_of_one_call_per_prompt(
    dapo_prompts, qwen3_tokenizer, tiny_tokenizer, thinking
):
    """The batched measure (one template call and one tokenizer batch per chunk, chunks smaller than the list)
    against `prompt_ids` called on each conversation alone."""
    for tok in (qwen3_tokenizer, tiny_tokenizer):
        want = [len(prompts.prompt_ids(tok, m, thinking)) for m in dapo_prompts["messages"]]
        assert prompts.prompt_lengths(dapo_prompts["messages"], tok, thinking, chunk=5) == want


def test_token_counts_are_the_tokenizers_own_with_or_without_its_backend(qwen3_tokenizer_dir, tiny_tokenizer):
    """A fast tokenizer that neither pads nor truncates is counted by its backend, any other through its call:
    both against the tokenizer called on each text alone; a backend set to truncate at 3 tokens is not
    counted by itself (it would say 3)."""
    from transformers import AutoTokenizer

    plain = ["<|im_start|>user\n12+30<|im_end|>\n<|im_start|>assistant\n", "12+30", ""]
    texts = ["Héllo 世界! 🤖 naïve café, and more words than three", *plain]
    qwen3 = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    for tok, some in ((qwen3, texts), (tiny_tokenizer, plain)):  # the tiny world's vocabulary is ASCII
        want = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in some]
        assert prompts.token_counts(tok, some) == want
    truncating = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    truncating.backend_tokenizer.enable_truncation(3)
    want = [len(qwen3(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert prompts.token_counts(truncating, texts) == want and max(want) > 3


def test_filter_keeps_everything_silently(dapo_prompts, tiny_tokenizer, recwarn):
    kept, n_dropped = prompts.filter_long_prompts(dapo_prompts, tiny_tokenizer, 100_000)
    assert n_dropped == 0 and len(kept) == 12 and not recwarn.list


def test_filter_all_too_long_raises(dapo_prompts, tiny_tokenizer):
    with pytest.raises(
        ValueError, match=r"all 12 prompts exceed max_prompt_length=5 \(shortest \d+, longest \d+"
    ):
        prompts.filter_long_prompts(dapo_prompts, tiny_tokenizer, 5)


def test_collator_left_pads(tiny_tokenizer):
    features = [
        {"messages": [{"role": "user", "content": "1+2"}], "answer": "3"},
        {"messages": [{"role": "user", "content": "100+200"}], "answer": "300"},
    ]
    collator = prompts.PromptCollator(tiny_tokenizer, max_prompt_length=64)
    batch = collator(features)
    prompts_BP, mask_BP = batch["prompts"], batch["prompt_attention_mask"]
    ids = [collator.prompt_ids(f["messages"]) for f in features]
    assert prompts_BP.dtype == torch.long and prompts_BP.shape == mask_BP.shape == (2, max(map(len, ids)))
    assert batch["answers"] == ["3", "300"]
    assert mask_BP.sum(1).tolist() == [len(x) for x in ids]
    assert mask_BP[0, :4].sum() == 0 and mask_BP[0, 4:].all()  # "100+200" is 4 chars longer
    assert (prompts_BP[0, :4] == tiny_tokenizer.pad_token_id).all()
    for row, mask, expected in zip(prompts_BP, mask_BP, ids):
        assert row[mask.bool()].tolist() == expected
        text = tiny_tokenizer.decode(row[mask.bool()])
        assert text.startswith("<|im_start|>user") and text.endswith(GEN_PROMPT)  # no BOS before it


def test_collator_rejects_too_long_prompt(tiny_tokenizer):
    collator = prompts.PromptCollator(tiny_tokenizer, max_prompt_length=8)
    with pytest.raises(ValueError, match="exceeds max_prompt_length=8; run filter_long_prompts"):
        collator([{"messages": [{"role": "user", "content": "1+2"}]}])


def test_collator_enable_thinking_with_qwen3(qwen3_tokenizer, dapo_prompts):
    assert qwen3_tokenizer.bos_token is None
    features = [dapo_prompts[0], dapo_prompts[1]]
    off = prompts.PromptCollator(qwen3_tokenizer, 1024, enable_thinking=False)(features)
    on = prompts.PromptCollator(qwen3_tokenizer, 1024, enable_thinking=True)(features)
    for batch, tail in ((off, GEN_PROMPT + QWEN3_NO_THINK), (on, GEN_PROMPT)):
        for row, mask in zip(batch["prompts"], batch["prompt_attention_mask"]):
            text = qwen3_tokenizer.decode(row[mask.bool()])
            assert text.startswith("<|im_start|>user\n") and text.endswith(tail)
    assert (off["prompt_attention_mask"].sum(1) > on["prompt_attention_mask"].sum(1)).all()
    assert off["answers"] == on["answers"] == [dapo_prompts[0]["answer"], dapo_prompts[1]["answer"]]


def test_format_first_prompt(dapo_prompts, qwen3_tokenizer):
    collator = prompts.PromptCollator(qwen3_tokenizer, 1024)
    text = prompts.format_first_prompt(dapo_prompts, collator, qwen3_tokenizer)
    n = len(collator.prompt_ids(dapo_prompts[0]["messages"]))
    assert f"[{n} tokens" in text and text.endswith(GEN_PROMPT + QWEN3_NO_THINK)
