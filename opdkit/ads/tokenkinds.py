"""Completion tokens by kind, and the gradient variants that keep some kinds only (savegrad's `grad_tokens`).

    entropy_R = teacher_entropies(teacher, rows, batch_size=8, pad_token_id=0)   # per row, per token
    kinds_R = token_kinds(rows, entropy_R, tokenizer, task.answer_start, 0.3)    # answer/uncertain/confident
    kept = keep_kinds(rows, kinds_R, GRAD_TOKENS["confident"])   # the loss on those kinds only
    rows = answer_rows(traces, tokenizer, task.answer_start)     # the loss kept on each trace's final answer

A trace's completion token is `answer` when it belongs to the final answer (`Task.answer_start`), else
`uncertain` when the teacher's entropy at the position that predicts it is above a threshold (nats; the
teacher hesitating between equally good continuations, e.g. the order of a sum's columns), else `confident`.
The gradient variants keep the loss on: `all` every completion token (the rows untouched), `confident` the
confident and answer tokens (the completion gradient without the teacher's hesitations), `answer` the answer
tokens only. A trace left with no kept token drops out of the mean (as one without an answer does).

The teacher scores the very token ids the proxy reads, so it must share the proxy's vocabulary (the caller
checks); its entropies are taken from the final hidden states a chunk of rows at a time, no B x T x V logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from opdkit.ads.gradient import plain_head
from opdkit.data.labels import IGNORE, make_batches, shifted_labels

KINDS = ("answer", "uncertain", "confident")
# grad_tokens -> the kinds whose tokens keep their loss (None: every completion token, the rows as they are)
GRAD_TOKENS: dict[str, frozenset[str] | None] = {
    "all": None,
    "confident": frozenset({"confident", "answer"}),
    "answer": frozenset({"answer"}),
}
_ENTROPY_ROWS = 512  # completion positions per chunk of the teacher's head


def answer_labels(tok: Any, input_ids: list[int], labels: list[int], start: int) -> list[int]:
    """`labels` with everything before the answer (character `start` of the completion) set to -100: the first
    completion token whose decoded prefix reaches past `start`, found by bisection, and all after it."""
    pos = [i for i, t in enumerate(labels) if t != IGNORE]
    lo, hi = 0, len(pos) - 1
    while lo < hi:  # smallest j with len(decode(completion[: j + 1])) > start
        mid = (lo + hi) // 2
        if len(tok.decode(input_ids[pos[0] : pos[mid] + 1], skip_special_tokens=True)) > start:
            hi = mid
        else:
            lo = mid + 1
    return [t if i >= pos[lo] else IGNORE for i, t in enumerate(labels)]


def answer_rows(held: Sequence[dict], tok: Any, answer_start: Callable[[str], int | None]) -> list[dict]:
    """Traces ({messages, input_ids, labels}) with the loss on their answer tokens only (`answer_start(text)`:
    where a completion's final answer begins, a task's); traces without an answer are left out."""
    rows = []
    for t in held:
        start = answer_start(t["messages"][-1]["content"])
        if start is not None and any(x != IGNORE for x in t["labels"]):
            rows.append(
                {
                    "input_ids": t["input_ids"],
                    "labels": answer_labels(tok, t["input_ids"], t["labels"], start),
                }
            )
    return rows


@torch.no_grad()
def teacher_entropies(
    teacher: torch.nn.Module, rows: Sequence[dict], batch_size: int, pad_token_id: int
) -> list[list[float | None]]:
    """Per row, per token: the entropy (nats, temperature 1) of the teacher's prediction of that completion
    token (made at the position before it); None for tokens outside the completion."""
    device = next(teacher.parameters()).device
    out: list[list[float | None]] = [[None] * len(r["input_ids"]) for r in rows]
    for batch in make_batches(rows, range(len(rows)), batch_size, pad_token_id, device):
        keep_BT = shifted_labels(batch["labels"]) != IGNORE  # position t predicts completion token t+1
        entropy_N = _entropies(teacher, batch, keep_BT).tolist()
        for (b, t), h in zip(keep_BT.nonzero().tolist(), entropy_N):
            out[int(batch["trace_ids"][b])][t + 1] = h
    return out


def _entropies(teacher: torch.nn.Module, batch: dict, keep_BT: torch.Tensor) -> torch.Tensor:
    """The entropy at each kept position, from the final hidden states through the head, a chunk of rows at
    a time (full logits when the head is not a plain linear map)."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if not plain_head(teacher):
        return _entropy(teacher(**inputs).logits[keep_BT])
    none = torch.empty(0, dtype=torch.long, device=keep_BT.device)
    hidden_NH = teacher(**inputs, logits_to_keep=none, output_hidden_states=True).hidden_states[-1][keep_BT]
    weight_VH = teacher.get_output_embeddings().weight
    parts = [
        _entropy(F.linear(hidden_NH[s : s + _ENTROPY_ROWS], weight_VH))
        for s in range(0, hidden_NH.shape[0], _ENTROPY_ROWS)
    ]
    return torch.cat(parts) if parts else hidden_NH.new_zeros(0)


def _entropy(logits_RV: torch.Tensor) -> torch.Tensor:
    logp_RV = torch.log_softmax(logits_RV.float(), dim=-1)
    return -(logp_RV.exp() * logp_RV).sum(-1)


def token_kinds(
    rows: Sequence[dict],
    entropies: Sequence[Sequence[float | None]],
    tok: Any,
    answer_start: Callable[[str], int | None],
    threshold: float,
) -> list[list[str | None]]:
    """Per row ({messages, input_ids, labels}), per token: 'answer', 'uncertain' (not the answer, the
    teacher's entropy above `threshold`) or 'confident' for completion tokens; None elsewhere."""
    out = []
    for r, entropy in zip(rows, entropies):
        start = answer_start(r["messages"][-1]["content"])
        answer = None
        if start is not None and any(x != IGNORE for x in r["labels"]):
            answer = answer_labels(tok, r["input_ids"], r["labels"], start)
        kinds: list[str | None] = []
        for i, label in enumerate(r["labels"]):
            if label == IGNORE:
                kinds.append(None)
            elif answer is not None and answer[i] != IGNORE:
                kinds.append("answer")
            else:
                kinds.append("uncertain" if entropy[i] > threshold else "confident")
        out.append(kinds)
    return out


def keep_kinds(
    rows: Sequence[dict], kinds: Sequence[Sequence[str | None]], keep: frozenset[str]
) -> list[dict]:
    """The rows with the loss on the tokens of the kinds in `keep` only; a row left with none is dropped."""
    out = []
    for r, row_kinds in zip(rows, kinds):
        labels = [lab if kind in keep else IGNORE for lab, kind in zip(r["labels"], row_kinds)]
        if any(lab != IGNORE for lab in labels):
            out.append({"input_ids": r["input_ids"], "labels": labels})
    return out


def kind_counts(kinds: Sequence[Sequence[str | None]]) -> dict[str, int]:
    """Completion tokens of each kind over all rows."""
    return {kind: sum(1 for row in kinds for k in row if k == kind) for kind in KINDS}
