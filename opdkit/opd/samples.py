"""samples.jsonl: a few of a step's rollouts as a person reads them, every `sample_every` steps: each one's
context (the tokens before its first loss token), its loss tokens with their divergence, its answer, and for a
multi-turn episode its parts in order (`turns`: the student's turns and the tools' between them).

    samples = SampleKeeper(every=10, per_log=4)
    samples.keep(record, pred_BT, per_token_N, step)     # in the loss: device tensors, no host read
    for row in samples.rows(tokenizer): run.log(row, "samples.jsonl")    # at the logging step, rank 0
    samples.clear()

The rows kept are those sampled first in the step (micro-batches are grouped by length, so these are a fair
draw, not the shortest), whatever micro-batch their length put them in; they stay device tensors until the
logging step reads them, one host copy per kept micro-batch.
"""

from __future__ import annotations

import torch

from opdkit.rollout.source import RolloutRecord


class SampleKeeper:
    """The kept rows of the steps since the last logging step (`every` 0: none)."""

    def __init__(self, every: int, per_log: int):
        self.every, self.per_log = every, per_log
        self._kept: list[dict] = []

    def keep(
        self, record: RolloutRecord, pred_BT: torch.Tensor, per_token_N: torch.Tensor, step: int
    ) -> None:
        """A micro-batch of step `step` (0-based): the rows of it among the step's first `per_log` sampled,
        if the step is one that writes samples. `per_token_N`: every row's predicting positions' divergence,
        row after row."""
        number = step + 1
        if not (self.every and number % self.every == 0):
            return
        keep = [b for b, place in enumerate(record.sampled_as) if place < self.per_log]
        if keep:
            self._kept.append(
                {
                    "step": number,
                    "keep": keep,
                    "record": record,
                    "pred_BT": pred_BT,
                    "per_token_N": per_token_N,
                }
            )

    def rows(self, tokenizer) -> list[dict]:
        """The kept rows as samples.jsonl rows, in sampling order."""
        rows = []
        for s in self._kept:
            r = s["record"]
            ids_BT, context_BT, loss_BT = r.input_ids_BT.cpu(), r.context_BT().cpu(), r.loss_mask_BT.cpu()
            counts = s["pred_BT"].sum(1).cpu().tolist()
            divs = s["per_token_N"].cpu().split(counts)
            for b in s["keep"]:
                sample = {
                    "step": s["step"],
                    "prompt": tokenizer.decode(ids_BT[b][context_BT[b]]),
                    "tokens": tokenizer.convert_ids_to_tokens(ids_BT[b][loss_BT[b].bool()].tolist()),
                    "divergence": [round(d, 5) for d in divs[b].tolist()],
                    "answer": r.answers[b],
                }
                parts = turns(ids_BT[b], loss_BT[b], r.attention_mask_BT[b].cpu())
                if (
                    len(parts) > 1
                ):  # a multi-turn episode: its parts in order, the tools' between the student's
                    sample["turns"] = [
                        {"sampled": m, "text": tokenizer.decode(t), **({"n_tokens": len(t)} if m else {})}
                        for m, t in parts
                    ]
                rows.append(((s["step"], r.sampled_as[b]), sample))
        return [sample for _, sample in sorted(rows, key=lambda r: r[0])]

    def clear(self) -> None:
        self._kept = []


def turns(ids_T: torch.Tensor, loss_T: torch.Tensor, attn_T: torch.Tensor) -> list[tuple[bool, list[int]]]:
    """A row after its context as runs of (sampled by the student, token ids): the student's turns (loss mask
    1) and what came between them (the template's and the tools' tokens, attended, mask 0)."""
    runs: list[tuple[bool, list[int]]] = []
    first = loss_T.bool().nonzero()
    if not len(first):
        return runs
    start = int(first[0])
    for i, m, a in zip(ids_T.tolist()[start:], loss_T.tolist()[start:], attn_T.tolist()[start:]):
        if not a:
            continue
        if runs and runs[-1][0] == bool(m):
            runs[-1][1].append(i)
        else:
            runs.append((bool(m), [i]))
    return runs
