"""Accuracy, the one way every job measures it: greedy completions of held-out problems graded by their task,
raw and with each final answer forced, the problems split over the processes and the counts summed.

    acc = accuracy(model, tok, task, messages, answers, max_new_tokens=40)            # acc.raw, acc.forced
    acc = accuracy(model, tok, task, messages, answers, max_new_tokens=40, forced=True, world=2, rank=r)
    share = fraction_correct(r["correct"] for r in traces)                             # a teacher's traces
    acc = episode_accuracy(model, tok, env, messages, answers, max_turns=2, max_new_tokens=110)
    acc.raw, acc.tool_call_share, acc.called_share          # greedy episodes with a tool environment

Pitfalls this module exists for:
- every process decodes its own share (problems rank, rank + world, ...) and the counts are summed, so the
  accuracy does not depend on the process count; a sharded model (a teacher under FSDP) runs every forward as
  a collective, so each rank decodes as many prompts (where they do not divide, some repeat one whose answer
  is not counted) with the kit's loop stepping in lock-step;
- the kit's loop decodes under `bf16` autocast when asked, so before and after training compare one precision;
  a vLLM `engine` is synced with `model` first and decodes from its own weights;
- with a multi-turn environment (a config's `environment`) the accuracy is that of greedy episodes played by
  the rollouts' own loop (`rollout.multiturn.MultiTurnRollouts` at temperature 0, on the kit's loop or the
  vLLM `engine`), graded by the environment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from opdkit.config import ConfigError
from opdkit.data.prompts import PromptCollator
from opdkit.models import eos_ids
from opdkit.rollout import engines, greedy
from opdkit.rollout.episodes import CALLED_TOOL, CORRECT, TOOL_CORRECT, Environment
from opdkit.rollout.multiturn import MultiTurnRollouts
from opdkit.run import sharding
from opdkit.tasks import get_environment
from opdkit.tasks.base import Messages, Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


@dataclass
class Accuracy:
    """Greedy accuracy on `n` problems: `raw` (completions as written) and `forced` (each final answer forced;
    None when not measured). Of greedy episodes with tools (`episode_accuracy`): `raw` is the share graded
    correct by the environment, `tool_call_share` the share that called the tools correctly
    (`environment.called_correctly`: a call, none malformed, a result that is the reference answer),
    `called_share` the share with any call (the episodes' metrics `CORRECT`, `TOOL_CORRECT`, `CALLED_TOOL`,
    `opdkit.rollout.episodes`)."""

    raw: float | None
    forced: float | None = None
    n: int = 0
    tool_call_share: float | None = None
    called_share: float | None = None


def fraction_correct(flags: Iterable[bool | None]) -> float | None:
    """The share of right answers among the checked ones (None: not checkable, e.g. no reference); None when
    none was checked."""
    checked = [bool(f) for f in flags if f is not None]
    return sum(checked) / len(checked) if checked else None


def accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    messages: Sequence[Messages],
    answers: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = 64,
    enable_thinking: bool = False,
    forced: bool = False,
    bf16: bool = False,
    engine: engines.HFEngine | engines.VLLMEngine | None = None,
    world: int = 1,
    rank: int = 0,
    progress: bool = False,
) -> Accuracy:
    """Greedy accuracy of `model` on `messages` graded by `task` against `answers`, this process decoding its
    share (`rank` of `world`) and the counts summed over processes; with `forced`, also with each final answer
    forced (`greedy.forced_completions`). The kit's loop decodes under bf16 autocast when `bf16`; a vLLM
    `engine` is synced with `model` first (on every rank: a sharded model's sync gathers)."""
    if not messages:
        return Accuracy(None, None, 0)
    if engine is not None:
        engine.sync(model)
    mine = list(range(rank, len(messages), world))
    decoded = mine
    if world > 1 and sharding.is_sharded(model) and engine is None:
        engine = engines.make_engine("hf", synced=True)
        decoded = mine + [(mine or [0])[-1]] * (-(-len(messages) // world) - len(mine))
    correct, correct_forced = 0.0, 0.0
    device = next(model.parameters()).device
    if decoded:
        mine_messages = [messages[i] for i in decoded]
        loop = engine is None or engine.name == "hf"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16 and loop):
            comps = greedy.greedy_completions(
                model,
                tokenizer,
                mine_messages,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                enable_thinking=enable_thinking,
                progress=progress,
                engine=engine,
            )
            if forced:
                comps_forced = greedy.forced_completions(
                    model,
                    tokenizer,
                    mine_messages,
                    comps,
                    task,
                    batch_size=batch_size,
                    enable_thinking=enable_thinking,
                    engine=engine,
                )
                # zip stops at this rank's own prompts: repeats decoded only to keep step are not counted.
                correct_forced = float(sum(task.check(c, answers[i]) for c, i in zip(comps_forced, mine)))
        correct = float(sum(task.check(c, answers[i]) for c, i in zip(comps, mine)))
    if world > 1 and dist.is_initialized():
        t = torch.tensor([correct, correct_forced], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        correct, correct_forced = t.tolist()
    n = len(messages)
    return Accuracy(correct / n, correct_forced / n if forced else None, n)


@torch.no_grad()
def episode_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    environment: Environment,
    messages: Sequence[Messages],
    answers: Sequence[str],
    *,
    max_turns: int,
    max_new_tokens: int,
    episode_max_tokens: int = 0,
    batch_size: int = 64,
    enable_thinking: bool = False,
    bf16: bool = False,
    world: int = 1,
    rank: int = 0,
    engine: engines.HFEngine | engines.VLLMEngine | None = None,
) -> Accuracy:
    """Greedy episodes of `model` against `environment` (the training rollouts' loop,
    `MultiTurnRollouts`, at temperature 0 on the kit's engine, or on `engine`, synced with `model`, which
    takes this process's episodes in one call a turn: up to `max_turns` turns of `max_new_tokens`,
    `episode_max_tokens` in all), graded by the environment: `raw` the share correct, `tool_call_share` and
    `called_share` (`Accuracy`), from the episodes' summed metrics (`MultiTurnRollouts.counts`). This
    process plays its share (`rank` of `world`); the counts are summed over processes."""
    if not messages:
        return Accuracy(None, None, 0)
    if world > 1 and sharding.is_sharded(model):
        raise ConfigError(
            "the accuracy of multi-turn episodes is not built for a sharded model (episodes end at different "
            "turns on each process); use parallelism ddp with an environment."
        )
    settings = engines.SamplingSettings(
        max_new_tokens, 0.0, 1.0, eos_ids(tokenizer, model), tokenizer.pad_token_id
    )
    mine = list(range(rank, len(messages), world))
    if engine is not None and engine.name == "vllm":
        batch_size = max(1, len(mine))  # vLLM batches by itself; one sync
    episodes = MultiTurnRollouts(
        engines.HFEngine if engine is None else lambda: engine,
        settings,
        seed=0,  # greedy: the keys draw nothing
        rank=0,
        world=1,
        batch_size=batch_size,
        environment=environment,
        tokenizer=tokenizer,
        max_turns=max_turns,
        episode_max_tokens=episode_max_tokens,
        enable_thinking=enable_thinking,
    )
    collate = PromptCollator(tokenizer, 1 << 30, enable_thinking, list(environment.tools))
    device = next(model.parameters()).device
    names = (CORRECT, TOOL_CORRECT, CALLED_TOOL)
    totals = dict.fromkeys(names, 0.0)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        for s in range(0, len(mine), batch_size):
            part = mine[s : s + batch_size]
            batch = collate([{"messages": messages[i], "answer": answers[i]} for i in part])
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            episodes.next_step(model, [batch], 0)
            for k in names:
                totals[k] += episodes.counts[k]
    sums = [totals[k] for k in names]
    if world > 1 and dist.is_initialized():
        t = torch.tensor(sums, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        sums = t.tolist()
    n = len(messages)
    correct, tool_correct, called = sums
    return Accuracy(correct / n, None, n, tool_correct / n, called / n)


def completion_budget(cfg) -> int:
    """A config's evaluation completion budget: `eval_max_new_tokens`, or when 0 the budget of what its
    students learned from: the teacher's traces where the job writes them (04: `trace_max_new_tokens`), else
    the student's rollouts (02: `rollout_max_new_tokens`)."""
    learned = cfg.trace_max_new_tokens if hasattr(cfg, "trace_max_new_tokens") else cfg.rollout_max_new_tokens
    return cfg.eval_max_new_tokens or learned


def evaluation_tokens(cfg) -> int:
    """The most tokens an evaluation answer holds after its prompt: the completion budget, or with an
    `environment` a greedy episode at its longest (`episode_max_tokens`, else `max_turns` turns of the
    completion budget; the tools' results between them are not counted there), as `configured_accuracy`
    plays them."""
    if not getattr(cfg, "environment", ""):
        return completion_budget(cfg)
    return cfg.episode_max_tokens or cfg.max_turns * completion_budget(cfg)


def configured_accuracy(
    cfg,
    model,
    tokenizer,
    task: Task,
    messages,
    answers,
    *,
    forced: bool | None = None,
    bf16: bool | None = None,
    **kwargs,
) -> Accuracy:
    """`accuracy` with a config's evaluation settings (`EvalSettings`, beside `completion_budget`'s,
    `enable_thinking` and `bf16`): its completion budget and batch size; forced when `forced_accuracy` (or
    `forced`), under bf16 autocast when `bf16` (or `bf16`, when given). `kwargs`: engine, world, rank,
    progress. With an `environment` (a config's multi-turn setting) greedy episodes (`episode_accuracy`, up
    to `max_turns` turns of the completion budget, `episode_max_tokens` in all), nothing forced."""
    bf16 = getattr(cfg, "bf16", False) if bf16 is None else bf16
    if getattr(cfg, "environment", ""):
        return episode_accuracy(
            model,
            tokenizer,
            get_environment(cfg.environment, task),
            messages,
            answers,
            max_turns=cfg.max_turns,
            max_new_tokens=completion_budget(cfg),
            episode_max_tokens=cfg.episode_max_tokens,
            batch_size=cfg.eval_batch_size,
            enable_thinking=cfg.enable_thinking,
            bf16=bf16,
            world=kwargs.get("world", 1),
            rank=kwargs.get("rank", 0),
            engine=kwargs.get("engine"),
        )
    return accuracy(
        model,
        tokenizer,
        task,
        messages,
        answers,
        max_new_tokens=completion_budget(cfg),
        batch_size=cfg.eval_batch_size,
        enable_thinking=cfg.enable_thinking,
        forced=cfg.forced_accuracy if forced is None else forced,
        bf16=bf16,
        **kwargs,
    )
