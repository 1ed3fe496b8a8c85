"""A trace the teacher did not finish keeps no end-of-turn target it never wrote (01's proxy gradient; 04's
students: tests/test_sft_student.py), and 01 counts such traces in grads.json."""

from __future__ import annotations

import json

from opdkit.data import traces
from opdkit.data.labels import IGNORE, completion_labels
from opdkit.jobs import savegrad

CONTENT = "Let me add: 2 + 3 is 5, and then 5 + 4"  # cut off mid-sentence


def _messages(content: str = CONTENT) -> list[dict]:
    return [{"role": "user", "content": "What is 2+3+4?"}, {"role": "assistant", "content": content}]


def test_qwen3_truncated_trace_labels_only_what_was_written(qwen3_tokenizer):
    tok = qwen3_tokenizer
    ids, labels = completion_labels(tok, _messages(), False, truncated=True)
    assert [t for t in labels if t != IGNORE] == tok.encode(CONTENT, add_special_tokens=False)
    assert ids[-1] == labels[-1] and tok.decode(ids).endswith(
        CONTENT
    )  # the input ends where the teacher stopped
    full_ids, full_labels = completion_labels(tok, _messages(), False, truncated=False)
    assert [t for t in full_labels if t != IGNORE] == tok.encode(
        CONTENT + "<|im_end|>", add_special_tokens=False
    )
    assert full_ids[: len(ids)] == ids


def test_with_labels_follows_each_record(tiny_tokenizer):
    records = [
        {"messages": _messages("3+2=5;5"), "truncated": True},
        {"messages": _messages("3+2=5;5"), "truncated": False},
        {"messages": _messages("3+2=5;5"), "truncated": None},
    ]
    done = [
        tiny_tokenizer.decode([t for t in r["labels"] if t != IGNORE])
        for r in traces.with_labels(records, tiny_tokenizer, False)
    ]
    assert done == ["3+2=5;5", "3+2=5;5<|im_end|>", "3+2=5;5<|im_end|>"]
    assert traces.truncated_count(records) == 1


def test_savegrad_counts_truncated_traces_and_drops_their_end_of_turn(tmp_path, tiny_tokenizer):
    run = savegrad.run(
        "tiny", {"run_dir": str(tmp_path / "cut"), "subset_size": 4, "trace_max_new_tokens": 6}
    )
    rows = list(traces.load_traces(run))
    assert all(r["truncated"] for r in rows)
    for r in rows:
        assert tiny_tokenizer.decode([t for t in r["labels"] if t != IGNORE]) == r["messages"][-1]["content"]
    meta = json.loads((run.path / "grads.json").read_text())
    assert meta["truncated_traces"] == run.read_summary()["truncated_traces"] == 4
