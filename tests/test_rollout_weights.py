"""opdkit.rollout.weights: the producer's one weight-transfer format. A tied tensor (the tiny student ties
its embedding and head) is held once and its tie restored, in memory, through a move, and through a
checkpoint file (`ahead.save_queued` / `ahead.load_queued`: the tie kept across a resume, issue 47 item 4);
a model loaded from it keeps its tie; the log-probabilities under weights are checked in
tests/test_rollout_ahead.py."""

from __future__ import annotations

import torch
from helpers import tiny_model

from opdkit.rollout import ahead, engines
from opdkit.rollout.weights import Weights

HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _tied(state: dict[str, torch.Tensor]) -> bool:
    return state[HEAD] is state[EMBED]


def test_a_tied_tensor_is_held_once_and_its_tie_restored():
    model = tiny_model("tiny:student")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    w = Weights.copy_of(model)
    assert w.ties == {HEAD: EMBED} and HEAD not in w.tensors
    assert [name for name, _ in w.each()] == list(w.tensors)
    assert _tied(w.state()) and _tied(w.on("cpu").state())
    assert set(w.state()) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert torch.equal(w.state()[name], t) and w.state()[name].data_ptr() != t.data_ptr()  # a copy


def _source_with_queued(weights: dict[int, Weights], plans: dict[int, int]) -> ahead.AheadRollouts:
    """A source sampling ahead that has queued `plans` (step -> version) with `weights` (no producer)."""
    settings = engines.SamplingSettings(
        max_new_tokens=4, temperature=1.0, top_p=1.0, eos_token_ids=[0], pad_token_id=0
    )
    src = ahead.AheadRollouts(engines.HFEngine, None, settings, 0, 0, 1, 4, 1, "cpu")
    src._queued, src._kept = dict(plans), dict(weights)
    return src


def test_the_tie_is_kept_across_a_checkpoint_and_a_resume(tmp_path):
    """Saved with a checkpoint and loaded back, each version's weights still hold the head and the embedding
    as one tensor (the old format saved a clone under each name and loaded two tensors); a model loaded from
    them keeps its tie and the values; the resumed source hands out the same."""
    model, other = tiny_model("tiny:student"), tiny_model("tiny:student")
    with torch.no_grad():
        other.get_input_embeddings().weight.add_(0.5)
    kept = {2: Weights.copy_of(model), 3: Weights.copy_of(other)}
    ahead.save_queued(_source_with_queued(kept, {4: 2, 5: 3}), tmp_path)
    plans, weights = ahead.load_queued(tmp_path)
    assert plans == {4: 2, 5: 3} and sorted(weights) == [2, 3]
    for v, w in weights.items():
        state = w.state()
        assert _tied(state), v
        for name, t in kept[v].state().items():
            assert torch.equal(state[name], t), (v, name)
    fresh = tiny_model("tiny:student")
    fresh.load_state_dict(weights[3].state())
    assert fresh.get_output_embeddings().weight is fresh.get_input_embeddings().weight
    assert torch.equal(fresh.get_output_embeddings().weight, other.get_output_embeddings().weight)
    resumed = _source_with_queued({}, {})
    resumed.resume(plans, weights)
    assert _tied(resumed.weights_of(2).state()) and _tied(resumed.weights_of(3).state())


def test_a_checkpoint_without_queued_steps_loads_as_none(tmp_path, capsys):
    assert ahead.load_queued(tmp_path) is None
    _source_with_queued({}, {}).load(tmp_path)
    assert "keeps no rollouts sampled ahead" in capsys.readouterr().out
