"""Traces: conversations a teacher wrote, tokenized for the model that learns from them, and the folder
that keeps exactly what a gradient or a student was computed on. One record layout for every job (01's
traces/, 04's traces.jsonl): `messages`, the prompt then the teacher's assistant turn, beside what is known
of it (`answer`, `correct`, `truncated`).

    rec = trace(prompt_messages, text, answer="7", correct=True, truncated=False)
    completion(rec)                            # the teacher's text: the last turn's content
    rows = with_labels(records, tokenizer)     # + input_ids, labels (-100 outside the completion)
    save_traces(run.path / TRACES_DIR, rows); ds = load_traces(run.path)
    print(format_trace(tokenizer, row["input_ids"], row["labels"]))   # the completion in ⟦ ⟧
"""

from __future__ import annotations

from pathlib import Path

import datasets
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from opdkit.config import MissingInput
from opdkit.data.labels import IGNORE, completion_labels
from opdkit.run.files import atomic_path

TRACES_DIR = "traces"
COLUMNS = ("messages", "input_ids", "labels", "answer", "correct", "truncated")


def trace(prompt: list[dict], text: str, **facts) -> dict:
    """A trace record: the prompt's messages then the teacher's `text` as the assistant turn, then `facts`."""
    return {"messages": [*prompt, {"role": "assistant", "content": text}], **facts}


def completion(record: dict) -> str:
    """The teacher's text of a trace record (its last turn)."""
    return record["messages"][-1]["content"]


def with_labels(records: list[dict], tok: PreTrainedTokenizerBase, enable_thinking: bool) -> list[dict]:
    """Each trace with `tok`'s `input_ids` and `labels` (-100 outside the completion) added; a truncated one
    ends where the teacher stopped writing."""
    out = []
    for i, rec in enumerate(
        tqdm(records, desc="tokenizing traces", leave=False, disable=len(records) < 1000)
    ):
        try:
            ids, labels = completion_labels(tok, rec["messages"], enable_thinking, bool(rec.get("truncated")))
        except ValueError as exc:
            raise ValueError(f"trace {i}: {exc}") from exc
        out.append({**rec, "input_ids": ids, "labels": labels})
    return out


def truncated_count(records: list[dict]) -> int:
    """Traces the teacher did not finish (supplied traces, whose ending is unknown, count as finished)."""
    return sum(bool(r.get("truncated")) for r in records)


def save_traces(path: Path, records: list[dict]) -> None:
    """Write the traces folder atomically: a complete `traces/` or none."""
    ds = datasets.Dataset.from_dict({c: [r[c] for r in records] for c in COLUMNS})
    with atomic_path(path) as tmp:
        ds.save_to_disk(str(tmp))


def load_traces(run_path: str | Path) -> datasets.Dataset:
    """The `traces/` folder of a run directory (savegrad's); a RunDir works too."""
    path = Path(getattr(run_path, "path", run_path)) / TRACES_DIR
    if not path.is_dir():
        raise MissingInput(f"no traces at {path}; expected the folder savegrad writes in its run directory.")
    return datasets.load_from_disk(str(path))


def format_trace(tok: PreTrainedTokenizerBase, input_ids: list[int], labels: list[int]) -> str:
    """A trace as the proxy reads it, special tokens kept, the completion (where the loss is) in ⟦ ⟧."""
    out, start = [], 0
    for k in range(1, len(input_ids) + 1):
        if k == len(input_ids) or (labels[k] == IGNORE) != (labels[start] == IGNORE):
            text = tok.decode(input_ids[start:k], skip_special_tokens=False)
            out.append(text if labels[start] == IGNORE else f"⟦{text}⟧")
            start = k
    return "".join(out)
