"""Prompt-only data for on-policy distillation: load, normalise, filter, collate.

    ds = load_prompts("data/dapo-math-17k.parquet", subset_size=1000, seed=42)  # or a hub name
    ds, n_dropped = filter_long_prompts(ds, tokenizer, max_prompt_length=1024)
    collator = PromptCollator(tokenizer, max_prompt_length=1024)             # a Trainer data_collator
    print0(format_first_prompt(ds, collator, tokenizer))                       # look before training

Every source becomes the same two columns: `messages` (the prompt conversation, no assistant answer)
and `answer` (the reference final answer, "" when unknown; a task reads it from its rows: `reference`,
e.g. `opdkit.tasks.math.Math.reference_answer`). A Trainer must keep them, so set
`remove_unused_columns=False`. The tiny world's prompts are its task's (`opdkit.tasks.tiny`), not a file.

Pitfalls this module exists for:
- a mistyped local path must fail here, in milliseconds, not reach the Hub (or a GB model load) and
  fail there with an unrelated message; a damaged file (a half-downloaded parquet) must name its path
  (`UnreadableData`), not stop in pyarrow with "Parquet magic bytes not found";
- the prompt must end with the chat template's own generation prompt (for Qwen3 with thinking off,
  "<|im_start|>assistant\\n" plus an empty think block), since the student continues from it: it is
  rendered by the template with `add_generation_prompt=True`, never written as a literal;
- a prompt longer than `max_prompt_length` is dropped up front (with a warning), never truncated,
  since cutting either end would change the question or remove the generation prompt;
- no BOS is assumed (Qwen tokenizers have none); whatever the template emits is the prompt;
- `datasets` and pyarrow are imported only where a file or folder is read (`PromptCollator` works without
  them: bench/gpu.sh's offline install has neither, they are 50 MB).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from opdkit.config import ConfigError, MissingInput
from opdkit.rollout import sampling

if TYPE_CHECKING:
    import datasets

FILE_LOADERS = {  # suffix -> the datasets.Dataset constructor that reads it
    ".parquet": "from_parquet",
    ".jsonl": "from_json",
    ".json": "from_json",
    ".arrow": "from_file",
}
PROMPT_COLUMNS = ("messages", "prompt", "question", "problem")  # in order of preference
# A Hub repo id: "name" or "owner/name" with letters, digits, "-", "_", ".".
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


Reference = Callable[[dict, "str | None"], str]  # (row, its assistant turn or None) -> reference answer
OVERLAP_KINDS = ("train_in_eval", "eval_in_train", "train_in_excluded", "eval_repeats")


def removed(**counts: int) -> dict[str, int]:
    """Rows passed over to keep the sets apart, by kind (every kind present): `train_in_eval`, training rows
    whose prompt is an evaluation prompt; `eval_in_train`, evaluation candidates that are training prompts;
    `train_in_excluded`, training rows in the excluded set (a gradient's holdout); `eval_repeats`,
    evaluation candidates repeating one already taken."""
    return {k: counts.get(k, 0) for k in OVERLAP_KINDS}


def plain_reference(row: dict, assistant: str | None) -> str:
    """The reference answer as a row holds it: `answer`, then `reward_model.ground_truth`, `solution`, the
    assistant turn, stripped; a task that knows its rows' format reads the final answer out of it."""
    sources = reference_sources(row, assistant)
    return sources[0].strip() if sources else ""


def reference_sources(row: dict, assistant: str | None) -> list[str]:
    """The non-empty places a row may keep its reference, in order: `answer`, `reward_model.ground_truth`
    (the verl schema of DAPO-Math-17k), `solution`, the assistant turn."""
    reward = row.get("reward_model")
    sources = [
        row.get("answer"),
        reward.get("ground_truth") if isinstance(reward, dict) else None,
        row.get("solution"),
        assistant,
    ]
    return [str(v) for v in sources if v is not None and str(v).strip()]


def load_prompts(
    path: str,
    split: str = "train",
    subset_size: int = -1,
    seed: int = 42,
    reference: Reference = plain_reference,
) -> datasets.Dataset:
    """Prompts as a Dataset with columns `messages` and `answer` (`reference(row, assistant turn)`), a
    deterministic subset of `path`.

    `path` is a local `.parquet`/`.jsonl`/`.json`/`.arrow` file, a folder (from `save_to_disk`, or of data
    files), or a Hugging Face Hub dataset name. `split` picks the split of a DatasetDict folder or a Hub
    dataset; a single file is one split. The subset is the first `subset_size` rows after a shuffle with
    `seed` (-1: all rows, shuffled). Jobs load through their task (`opdkit.tasks.Task.load_prompts`).
    """
    if subset_size == 0 or subset_size < -1:
        raise ConfigError(
            f"subset_size={subset_size} is not a number of prompts to keep; expected -1 (all) or a positive "
            "count, so pass e.g. subset_size=1000."
        )
    if path == "tiny":
        raise ConfigError(
            "the tiny world's prompts are its task's, not a file: load them with "
            "opdkit.tasks.get_task('tiny').load_prompts(...)."
        )
    ds = load_raw(path, split)
    prompt_col = _prompt_column(ds, path)
    if len(ds) == 0:
        raise ConfigError(
            f"{path!r} (split {split!r}) holds no rows; expected at least one prompt, so check the source."
        )
    ds = ds.shuffle(seed=seed)
    if subset_size != -1 and subset_size < len(ds):
        ds = ds.select(range(subset_size))
    return _normalise(ds, prompt_col, reference)


def column(ds: datasets.Dataset, name: str) -> list:
    """`list(ds[name])` read in one go: iterating a `datasets` 4 column formats it row by row (a second for
    20,000 prompts, in every job's prepare and so in every dry run)."""
    return ds.select_columns([name])[:][name]


def prompt_key(messages: list[dict]) -> str:
    """What makes two prompts the same: the conversation's turns other than system messages (an instruction,
    not the problem), each with its whitespace collapsed. Jobs keep their sets apart by it."""
    return "\n".join(
        f"{m['role']}: {' '.join(str(m['content']).split())}" for m in messages if m["role"] != "system"
    )


def prompt_keys(conversations: Sequence[list[dict]]) -> set[str]:
    return {prompt_key(m) for m in conversations}


@dataclass
class Apart:
    """Rows kept by `apart_from`, in their order, and how many it passed over and why."""

    kept: list[int]
    overlap: int = 0  # rows whose prompt is among the ones to keep apart from
    repeats: int = 0  # rows repeating the prompt of a row kept before (when distinct)


def apart_from(
    conversations: Sequence[list[dict]], taken: set[str], limit: int = -1, distinct: bool = False
) -> Apart:
    """The first `limit` (-1: all) of `conversations` whose prompt (`prompt_key`) is not in `taken`, and,
    with `distinct`, not a repeat of one kept before: the one rule by which every job keeps its evaluation
    prompts off its training prompts, and its training prompts off a gradient's holdout."""
    out, seen = Apart([]), set()
    for i, messages in enumerate(conversations):
        if 0 <= limit <= len(out.kept):
            break
        key = prompt_key(messages)
        if key in taken:
            out.overlap += 1
        elif distinct and key in seen:
            out.repeats += 1
        else:
            out.kept.append(i)
            seen.add(key)
    return out


def overlap_count(conversations: Sequence[list[dict]], taken: set[str]) -> int:
    """How many of `conversations` have a prompt in `taken`."""
    return sum(prompt_key(m) in taken for m in conversations)


def load_apart(
    path: str,
    split: str,
    size: int,
    seed: int,
    taken: set[str],
    distinct: bool = True,
    reference: Reference = plain_reference,
) -> tuple[datasets.Dataset, Apart]:
    """`size` prompts (-1: all) of `path` in its `seed` shuffle whose prompts are not in `taken` (and
    distinct): (the rows, what was passed over). The head of the shuffle is read first; the whole file only
    when passing over rows leaves too few (as in raw DAPO-Math-17k, which repeats each prompt)."""
    ds = load_prompts(path, split, size, seed, reference)
    got = apart_from(column(ds, "messages"), taken, size, distinct)
    if size != -1 and len(got.kept) < size and len(ds) == size:
        ds = load_prompts(path, split, -1, seed, reference)
        got = apart_from(column(ds, "messages"), taken, size, distinct)
    return ds.select(got.kept), got


def _looks_local(path: str) -> bool:
    """A path meant as a file or folder here: it cannot be a Hub id, or it names a data file."""
    return (
        path.startswith((".", "/", "~"))
        or Path(path).suffix in FILE_LOADERS
        or "\\" in path
        or not _HUB_ID.match(path)
    )


class UnreadableData(ConfigError):
    """A local data file or folder exists but cannot be read as what its name says it is."""


def load_raw(path: str, split: str) -> datasets.Dataset:
    """The rows of a local file or folder, else of a Hub dataset. A missing local path fails here without
    any download; an unreadable one (a corrupt parquet, a half-written download) names its path."""
    import datasets

    local = Path(path).expanduser()
    if local.is_file():
        loader = getattr(datasets.Dataset, FILE_LOADERS.get(local.suffix, ""), None)
        if loader is None:
            raise ConfigError(
                f"cannot read {path!r}: its type {local.suffix!r} is not one of {sorted(FILE_LOADERS)}; "
                "convert it (e.g. Dataset.from_csv(...).to_parquet(...)) or save it with save_to_disk."
            )
        if _readable(path, lambda: _is_empty_file(local), f"a {local.suffix} file"):
            raise ConfigError(f"{path!r} holds no rows; expected at least one prompt, so check the file.")
        return _readable(path, lambda: loader(str(local)), f"a {local.suffix} file")
    if local.is_dir():
        if (local / "dataset_dict.json").exists() or (local / "state.json").exists():
            saved = _readable(
                path, lambda: datasets.load_from_disk(str(local)), "a datasets save_to_disk folder"
            )
            return _pick_split(saved, split, path)
        return _readable(
            path, lambda: datasets.load_dataset(str(local), split=split), "a folder of data files"
        )
    if _looks_local(path):
        raise MissingInput(
            f"no file or folder at {path!r} (resolved to {local.resolve()}); expected a local "
            f"{'/'.join(FILE_LOADERS)} file or a save_to_disk folder, so check the path and working "
            "directory."
        )
    return datasets.load_dataset(path, split=split)


def _readable(path: str, read, expected: str):
    """`read()`, with any failure to parse reported as this path's, with what it was expected to be."""
    import datasets

    try:
        return read()
    except (OSError, ValueError, datasets.exceptions.DatasetGenerationError) as exc:
        if isinstance(exc, (FileNotFoundError, UnreadableData)):
            raise
        raise UnreadableData(
            f"cannot read {path!r} as {expected} ({type(exc).__name__}: {exc}); the file is damaged or is "
            "not what its name says: re-create it (e.g. python -m opdkit.data.prepare) or point to another."
        ) from exc


def _is_empty_file(local: Path) -> bool:
    """Cheap emptiness checks, since the file builders fail on empty files with unrelated messages."""
    size = local.stat().st_size
    if size == 0:
        return True
    if local.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(local).metadata.num_rows == 0
    return local.suffix == ".json" and size < 1024 and local.read_text().strip() in ("[]", "{}")


def _pick_split(loaded: datasets.Dataset | datasets.DatasetDict, split: str, path: str) -> datasets.Dataset:
    import datasets

    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split not in loaded:
        raise ConfigError(
            f"{path!r} has no split {split!r}; it has {sorted(loaded)}, so pass one of them as split."
        )
    return loaded[split]


def _prompt_column(ds: datasets.Dataset, path: str) -> str:
    for col in PROMPT_COLUMNS:
        if col in ds.column_names:
            return col
    raise ConfigError(
        f"{path!r} has no usable prompt column: found {ds.column_names}, expected one of "
        f"{list(PROMPT_COLUMNS)}; rename yours with dataset.rename_column(old, 'prompt') and save it again."
    )


def _normalise(ds: datasets.Dataset, prompt_col: str, reference: Reference) -> datasets.Dataset:
    """Rows of any accepted layout as {"messages": prompt conversation, "answer": str}; read in one go
    (iterating a `datasets` 4 Dataset formats it row by row: a second for DAPO-Math-17k)."""
    messages, answers = [], []
    columns = ds[:]
    for i, values in enumerate(zip(*columns.values())):
        row = dict(zip(columns, values))
        convo = as_messages(row[prompt_col], i, prompt_col)
        final = convo.pop()["content"] if convo[-1]["role"] == "assistant" else None
        if not convo:
            raise ConfigError(
                f"row {i} of column {prompt_col!r} holds only an assistant turn; expected the prompt "
                "conversation (at least one user message) before it."
            )
        messages.append(convo)
        answers.append(reference(row, final))
    import datasets

    return datasets.Dataset.from_dict({"messages": messages, "answer": answers})


def as_messages(value: Any, row: int, col: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(
        f"row {row} of column {col!r} is {type(value).__name__} {str(value)[:80]!r}; expected a string or a "
        "non-empty list of {'role': ..., 'content': ...} messages, so fix that row or drop it."
    )


def prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    enable_thinking: bool = False,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids of one prompt conversation, chat-templated (with `tools`' JSON schemas where given) and
    ending with the generation prompt."""
    extra = {"tools": tools} if tools else {}
    enc = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        add_generation_prompt=True,
        enable_thinking=enable_thinking,
        return_dict=True,
        **extra,
    )
    return list(enc["input_ids"])


@dataclass
class PromptCollator:
    """`data_collator` for prompt-only batches: left-padded prompts plus their reference answers.

    Returns `prompts` (B×P, pad_token_id on the left), `prompt_attention_mask` (B×P) and `answers`; and
    `teacher_id` where the rows have that column (`opd.teachers.sets.RoutedTeacher` routes by it). With
    `tools` (a multi-turn environment's JSON schemas, [] for none) the prompts are templated with them and the
    batch keeps each row's conversation, `messages`, which the episodes start from (`rollout.multiturn`).
    P is the longest prompt of the batch; a prompt over `max_prompt_length` is an error (filter first).
    """

    tokenizer: PreTrainedTokenizerBase
    max_prompt_length: int
    enable_thinking: bool = False
    tools: list[dict] | None = None

    def __post_init__(self) -> None:
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={self.max_prompt_length}; expected a positive token count.")
        if self.tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token, which left padding needs; set "
                "tokenizer.pad_token = tokenizer.eos_token (or another unused token) first."
            )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return prompt_ids(self.tokenizer, messages, self.enable_thinking, self.tools)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor | list[str]]:
        ids = [self.prompt_ids(f["messages"]) for f in features]
        too_long = [len(x) for x in ids if len(x) > self.max_prompt_length]
        if too_long:
            raise ValueError(
                f"a prompt of {max(too_long)} tokens exceeds max_prompt_length={self.max_prompt_length}; "
                "run filter_long_prompts on the dataset first, or raise max_prompt_length."
            )
        prompts_BP, mask_BP = sampling.left_pad(ids, self.tokenizer.pad_token_id)
        out = {
            "prompts": prompts_BP,
            "prompt_attention_mask": mask_BP,
            "answers": [str(f.get("answer") or "") for f in features],
        }
        if any("teacher_id" in f for f in features):  # several teachers: the one each prompt is scored by
            out["teacher_id"] = [str(f.get("teacher_id") or "") for f in features]
        if self.tools is not None:  # episodes start from the conversations
            out["messages"] = [list(f["messages"]) for f in features]
        return out


def filter_long_prompts(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    enable_thinking: bool = False,
    tools: list[dict] | None = None,
) -> tuple[datasets.Dataset, int]:
    """(prompts whose templated length, with `tools` where given, is at most `max_prompt_length`, how many
    were dropped)."""
    keep = short_prompts(column(dataset, "messages"), tokenizer, max_prompt_length, enable_thinking, tools)
    n_dropped = len(dataset) - len(keep)
    return (dataset.select(keep) if n_dropped else dataset), n_dropped


def prompt_lengths(
    messages: list[list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    enable_thinking: bool = False,
    chunk: int = 2048,
    tools: list[dict] | None = None,
) -> list[int]:
    """`len(prompt_ids(...))` of every conversation (templated with `tools` where given), a chunk at a time:
    the chunk's texts templated in one call and tokenized in one batch (the same ids as one call per prompt,
    in a third of the time)."""
    lengths: list[int] = []
    extra = {"tools": tools} if tools else {}
    for i in tqdm(range(0, len(messages), chunk), desc="measuring prompts", leave=False):
        texts = tokenizer.apply_chat_template(
            list(messages[i : i + chunk]),
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
            **extra,
        )
        lengths += token_counts(tokenizer, texts)
    return lengths


def token_counts(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[int]:
    """How many tokens each text is, special tokens not added: a fast tokenizer's backend counts them (the
    ids `tokenizer(texts)` returns, without building its Python lists: a third of the measure's time) when
    it neither pads nor truncates; any other tokenizer through its call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.padding is None and backend.truncation is None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [len(encoding) for encoding in encode(texts, add_special_tokens=False)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def short_prompts(
    messages: list[list[dict]],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    enable_thinking: bool = False,
    tools: list[dict] | None = None,
) -> list[int]:
    """Indices of the prompts whose templated length (with `tools`) is at most `max_prompt_length`; the others
    are dropped with a warning that counts them, and none left is a ConfigError."""
    lengths = prompt_lengths(messages, tokenizer, enable_thinking, tools=tools)
    keep = [i for i, n in enumerate(lengths) if n <= max_prompt_length]
    if not keep:
        raise ConfigError(
            f"all {len(lengths)} prompts exceed max_prompt_length={max_prompt_length} (shortest "
            f"{min(lengths, default=0)}, longest {max(lengths, default=0)} tokens); raise max_prompt_length."
        )
    n_dropped = len(lengths) - len(keep)
    if n_dropped:
        warnings.warn(
            f"dropped {n_dropped} of {len(lengths)} prompts longer than "
            f"max_prompt_length={max_prompt_length} tokens (longest {max(lengths)}).",
            stacklevel=3,
        )
    return keep


def format_first_prompt(
    dataset: datasets.Dataset, collator: PromptCollator, tokenizer: PreTrainedTokenizerBase, tail: int = 400
) -> str:
    """The first prompt as the student sees it (special tokens kept), to check by eye before training.

    It should end with the chat template's generation prompt, from which the student continues.
    """
    batch = collator([dataset[0]])
    mask = batch["prompt_attention_mask"][0].bool()
    text = tokenizer.decode(batch["prompts"][0][mask], skip_special_tokens=False)
    shown = text if len(text) <= tail else "…" + text[-tail:]
    return f"first prompt [{int(mask.sum())} tokens; should end with the generation prompt]\n{shown}"
