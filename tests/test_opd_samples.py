"""opdkit.opd.samples: samples.jsonl keeps the rows sampled first, every `sample_every` steps, in sampling
order, each with its context, its loss tokens and their divergence; a row with tools between the student's
turns shows its parts in order (`turns`)."""

from __future__ import annotations

import torch

from opdkit.models import load_tokenizer
from opdkit.opd.samples import SampleKeeper, turns
from opdkit.rollout.source import RolloutRecord


def _record(tok) -> RolloutRecord:
    ids_BT = torch.tensor([tok("12+3=15")["input_ids"], tok("19+9=28")["input_ids"]])
    T = ids_BT.shape[1]
    loss_BT = torch.zeros_like(ids_BT)
    loss_BT[:, T - 3 :] = 1
    return RolloutRecord(
        input_ids_BT=ids_BT,
        attention_mask_BT=torch.ones_like(ids_BT),
        loss_mask_BT=loss_BT,
        truncated_B=torch.zeros(2, dtype=torch.bool),
        sampled_as=[5, 0],
        answers=["15", "28"],
    )


def test_the_rows_sampled_first_of_every_nth_step_in_sampling_order():
    tok = load_tokenizer("tiny:student")
    record = _record(tok)
    pred_BT = record.predicting_BT()
    per_token_N = torch.arange(int(pred_BT.sum()), dtype=torch.float32) / 10
    keeper = SampleKeeper(every=2, per_log=4)
    keeper.keep(record, pred_BT, per_token_N, step=0)  # step 1: not a sampling step
    assert keeper.rows(tok) == []
    keeper.keep(record, pred_BT, per_token_N, step=1)
    (row,) = keeper.rows(tok)  # only the row sampled first (place 0 < 4; place 5 is not)
    assert row["step"] == 2 and row["answer"] == "28" and row["divergence"] == [0.3, 0.4, 0.5]
    assert len(row["tokens"]) == 3 and "turns" not in row
    keeper.clear()
    assert keeper.rows(tok) == []


def test_a_row_splits_into_the_students_turns_and_what_came_between():
    ids_T = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    loss_T = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0])
    attn_T = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0])
    assert turns(ids_T, loss_T, attn_T) == [(True, [2, 3]), (False, [4, 5]), (True, [6]), (False, [7])]
    assert turns(ids_T, torch.zeros_like(loss_T), attn_T) == []
