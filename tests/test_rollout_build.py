"""opdkit.rollout.build: the settings choose the source, so the trainer names none: the synchronous one by
default, the producer sampling ahead with `rollout_ahead` (its log-probabilities in the engine's dtype), the
multi-turn episodes with an environment object (sampled ahead: by the producer); what cannot run is
refused in one line before anything starts."""

from __future__ import annotations

import pytest
from helpers import tiny_model

from opdkit.config import ConfigError
from opdkit.models import load_tokenizer
from opdkit.opd.arguments import OPDArguments
from opdkit.rollout import ahead, build, source
from opdkit.rollout.multiturn import MultiTurnRollouts


def _source(tmp_path, env=None, sharded=False, **settings):
    args = OPDArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings)
    tok = load_tokenizer("tiny:student")
    return build.rollout_source(
        args, tiny_model("tiny:student"), tok, [tok.eos_token_id], sharded=sharded, env=env
    )


class _Env:
    tools: list = []


def test_the_settings_choose_the_source(tmp_path):
    sync = _source(tmp_path)
    assert type(sync) is source.EngineRollouts and sync.ahead == 0 and sync.logprob_dtype() == "float32"
    assert sync.step_metrics(lambda t: t) == {} and sync.weights_of(0) is None
    assert sync.engine().name == "hf" and not sync.engine().logprobs
    produced = _source(tmp_path, rollout_ahead=2, rollout_device="cpu")
    assert isinstance(produced, ahead.AheadRollouts) and produced.ahead == 2
    assert produced.rollout_device == "cpu" and produced.logprob_dtype() == "float32"
    assert produced.make_engine().logprobs  # the producer's loop reports what the importance ratio reads
    episodes = _source(tmp_path, env=_Env(), environment="calculator", max_turns=3)
    assert isinstance(episodes, MultiTurnRollouts) and episodes.max_turns == 3
    ahead_episodes = _source(tmp_path, env=_Env(), environment="calculator", max_turns=3, rollout_ahead=1)
    assert isinstance(ahead_episodes, ahead.AheadRollouts)  # the producer plays them: its source is theirs
    assert isinstance(ahead_episodes.mirror, MultiTurnRollouts) and ahead_episodes.mirror.max_turns == 3


def test_what_cannot_run_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="environment object"):
        _source(tmp_path, environment="calculator")
    with pytest.raises(ConfigError, match="use parallelism ddp") as err:
        _source(tmp_path, sharded=True, rollout_ahead=1)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="use parallelism ddp, or no environment"):
        _source(tmp_path, env=_Env(), sharded=True, environment="calculator")
    unpicklable = _Env()
    unpicklable.check = lambda text, answer: True
    with pytest.raises(ConfigError, match="cannot be sent to it .*make it picklable") as err:
        _source(tmp_path, env=unpicklable, environment="calculator", rollout_ahead=1)
    assert "\n" not in str(err.value)
