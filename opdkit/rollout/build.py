"""The one place a run's rollout source is chosen and built from its settings, so that the trainer names no
rollout kind and no engine: synchronous (`source.EngineRollouts`) or multi-turn episodes against an
environment (`multiturn.MultiTurnRollouts`), either one in the training process or sampled ahead in a
producer process (`ahead.AheadRollouts`, which runs that source there); each through the engine
`rollout_engine` names (the kit's loop or vLLM, `engines.make_engine`).

    source = rollout_source(args, student, tokenizer, stop_ids, sharded=False, env=None)
    records = source.next_step(student, source.prompts(epoch_iterator, num_batches, step), step)

`args` is the trainer's `OPDArguments` (the settings of `settings.OPDSettings`, the process's place and
device); `env` the environment object a caller built from `environment` (`opdkit.tasks`, a higher room).
The engine factory holds no reference to the trainer: a cycle would keep a finished trainer's models alive
until a garbage collection.
"""

from __future__ import annotations

import functools
import pickle

import torch

from opdkit.config import ConfigError
from opdkit.rollout import ahead, engines
from opdkit.rollout.multiturn import MultiTurnRollouts
from opdkit.rollout.source import EngineRollouts, RolloutSource


def rollout_source(
    args,
    student: torch.nn.Module,
    tokenizer,
    stop_ids: list[int],
    *,
    sharded: bool,
    env=None,
    enable_thinking: bool = False,
) -> RolloutSource:
    """The source `args` name: `rollout_engine` synced with the student once per optimizer step; with
    `rollout_ahead` >= 1 a producer process sampling that many steps ahead through the same engine, built by
    the same factory there (one per training process, sampling that process's rows of the step's global
    batch); with `env`, episodes played against it (sampled ahead: by the producer, against a copy of `env`
    pickled into it). `sharded`: the student is sharded over processes (FSDP), whose forward is a collective
    every rank must enter together."""
    a = args
    ahead.check_settings(a, sharded)
    check_episodes(a, sharded)
    if a.environment and env is None:
        raise ConfigError(
            f"environment={a.environment}: the trainer plays episodes against an environment object; "
            "build the trainer with opd.build.distill_trainer, or pass env=tasks.get_environment(...)."
        )
    settings = engines.SamplingSettings(
        max_new_tokens=a.rollout_max_new_tokens,
        temperature=a.rollout_temperature,
        top_p=a.rollout_top_p,
        eos_token_ids=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = "bfloat16" if a.rollout_engine == "vllm" and a.bf16 else "float32"
    if a.rollout_engine == "hf":
        # A producer sampling ahead reports each token's log-probability, as vLLM does (the importance
        # ratio's).
        make = functools.partial(engines.make_engine, "hf", synced=sharded, logprobs=bool(a.rollout_ahead))
    else:
        make = functools.partial(
            engines.make_engine,
            "vllm",
            model_path=student.config.name_or_path,
            dtype=dtype,
            gpu_memory_utilization=a.vllm_gpu_memory_utilization,
            sleep=a.vllm_sleep,
            max_model_len=a.vllm_max_model_len,
            # one engine across the training processes; a producer's engine is its own
            distributed=a.world_size > 1 and not a.rollout_ahead,
        )
    place = (a.seed, a.process_index, a.world_size, a.train_batch_size)
    loop = EngineRollouts
    if env is not None:
        loop = functools.partial(
            MultiTurnRollouts,
            environment=env,
            tokenizer=tokenizer,
            max_turns=a.max_turns,
            episode_max_tokens=a.episode_max_tokens,
            enable_thinking=enable_thinking,
        )
    if not a.rollout_ahead:
        return loop(make, settings, *place)
    if env is not None:
        check_picklable(env, a.environment)
    return ahead.AheadRollouts(
        make,
        student.config,
        settings,
        *place,
        a.rollout_ahead,
        a.device,
        a.rollout_device or None,
        dtype,
        loop=loop,
    )


def check_episodes(s, sharded: bool) -> None:
    """What multi-turn episodes (`environment`) need beyond their settings: an unsharded student (refused in
    one line, by a job before its run folder is written and by `rollout_source`)."""
    if s.environment and sharded:
        raise ConfigError(
            f"environment={s.environment} with a sharded student (parallelism fsdp over several processes): "
            "each sharded forward is a collective every process enters together, and episodes end at "
            "different turns in each process; use parallelism ddp, or no environment."
        )


def check_picklable(env, name: str) -> None:
    """A producer sampling episodes ahead gets its copy of the environment pickled (as it gets the engine
    factory): one that cannot be is refused in one line, before the producer starts."""
    try:
        pickle.dumps(env)
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds; the line names it
        raise ConfigError(
            f"environment={name}: the producer of rollout_ahead plays the episodes in its own process, and "
            f"this {type(env).__name__} cannot be sent to it ({type(e).__name__}: {e}); make it picklable "
            "(no open files, sockets or lambdas), or use rollout_ahead 0."
        ) from None
