"""opdkit.data.labels: completion-only labels from the tiny chat template's generation markers and, without
them, from the rendered prompt; a truncated completion's labels; padded batches; each row's summed completion
loss against the model's own loss on that row alone. (Qwen3's template: test_ads_gradient.py; truncated Qwen3
traces: test_data_traces.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.data import labels
from opdkit.data.labels import IGNORE, completion_labels
from opdkit.tiny.tokenizer import CHAT_TEMPLATE, IM_END, build_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "358+467"}, {"role": "assistant", "content": "8+7=15,5+6+1=12,3+4+1=8;825"}],
    [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "1+2=3;3"}],
    [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "99+1"},
        {"role": "assistant", "content": "9+1=10,9+1=10;100"},
    ],
]


@pytest.fixture(scope="module")
def unmarked():
    """The tiny tokenizer with a template that has no `{% generation %}` markers."""
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return tok


def _prompt_ids(tok, messages: list[dict]) -> list[int]:
    return tok.apply_chat_template(
        messages[:-1], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_completion_and_its_end_of_turn_are_labelled_and_nothing_else(tiny_tokenizer, messages):
    tok = tiny_tokenizer
    ids, labs = completion_labels(tok, messages)
    prompt = _prompt_ids(tok, messages)
    completion = tok.encode(messages[-1]["content"] + IM_END)
    assert ids == prompt + completion + tok.encode("\n")
    assert labs == [IGNORE] * len(prompt) + completion + [IGNORE]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_without_generation_markers_the_prompt_locates_the_completion(tiny_tokenizer, unmarked, messages):
    assert completion_labels(unmarked, messages) == completion_labels(tiny_tokenizer, messages)


def test_without_generation_markers_the_last_turn_must_be_the_assistants(unmarked):
    with pytest.raises(ValueError, match="the last message must be the assistant's completion"):
        completion_labels(unmarked, CONVERSATIONS[0][:1])


def test_a_truncated_completion_keeps_no_end_of_turn(tiny_tokenizer):
    tok, messages = tiny_tokenizer, CONVERSATIONS[0]
    ids, labs = completion_labels(tok, messages, truncated=True)
    content = tok.encode(messages[-1]["content"])
    assert ids == _prompt_ids(tok, messages) + content  # the input ends where its writer stopped
    assert [t for t in labs if t != IGNORE] == content
    nothing = [IGNORE] * 4
    assert labels.without_end_of_turn(tok, [5, 6, 7, 8], nothing) == ([5, 6, 7, 8], nothing)


def test_right_padded_batches_of_rows(tiny_tokenizer):
    rows = [completion_labels(tiny_tokenizer, m) for m in CONVERSATIONS]
    batch = labels.right_pad_batch(rows, pad_token_id=0)
    width = max(len(ids) for ids, _ in rows)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, width)
    for b, (ids, labs) in enumerate(rows):
        n = len(ids)
        assert batch["input_ids"][b, :n].tolist() == ids and batch["labels"][b, :n].tolist() == labs
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (width - n)
        assert set(batch["input_ids"][b, n:].tolist()) <= {0} and set(batch["labels"][b, n:].tolist()) <= {
            IGNORE
        }
    sft = labels.sft_batch(tiny_tokenizer, CONVERSATIONS)
    assert all(torch.equal(sft[k], labels.right_pad_batch(rows, tiny_tokenizer.pad_token_id)[k]) for k in sft)


def test_batches_take_consecutive_indices_and_name_their_rows(tiny_tokenizer):
    rows = [dict(zip(("input_ids", "labels"), completion_labels(tiny_tokenizer, m))) for m in CONVERSATIONS]
    batches = list(labels.make_batches(rows, [2, 0, 1], 2, tiny_tokenizer.pad_token_id, "cpu"))
    assert [b["trace_ids"].tolist() for b in batches] == [[2, 0], [1]]
    assert batches[0]["input_ids"][1, : len(rows[0]["input_ids"])].tolist() == rows[0]["input_ids"]


def test_shifted_labels_are_what_each_position_predicts():
    labels_BT = torch.tensor([[IGNORE, 5, 6, 7], [IGNORE, IGNORE, 9, IGNORE]])
    assert labels.shifted_labels(labels_BT).tolist() == [[5, 6, 7, IGNORE], [IGNORE, 9, IGNORE, IGNORE]]


def test_token_losses_sum_the_models_own_loss_on_each_row_alone(tiny_tokenizer):
    """transformers' causal-LM loss on one unpadded row is the mean over its completion tokens; the padded
    batch's sums must be that mean times the row's count."""
    model = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")).eval()
    rows = [completion_labels(tiny_tokenizer, m) for m in CONVERSATIONS]
    batch = labels.right_pad_batch(rows, tiny_tokenizer.pad_token_id)
    with torch.no_grad():
        loss_sum_B, tokens_B = labels.token_losses(model, batch)
        for b, (ids, labs) in enumerate(rows):
            n = sum(t != IGNORE for t in labs)
            mean = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labs])).loss
            assert int(tokens_B[b]) == n
            torch.testing.assert_close(loss_sum_B[b], mean * n, rtol=1e-5, atol=1e-5)
