"""Rollouts sampled ahead of training (`rollout_ahead: s`): a producer process samples the rollouts of steps
k+1 … k+s while the trainer trains step k, through the run's rollout engine: the kit's loop on its own copy of
the student, or a vLLM engine of its own; single-turn completions, or multi-turn episodes against an
environment (`loop`: the synchronous source the producer runs).

    source = AheadRollouts(make_engine, student.config, settings, seed=42, rank=0, world=1, batch_size=64,
                           ahead=1, device="cpu")           # make_engine: the run's engine factory
    episodes = AheadRollouts(..., loop=functools.partial(MultiTurnRollouts, environment=env, tokenizer=tok,
                                                         max_turns=4))   # the producer plays the episodes
    batches = source.prompts(epoch_iterator, num_batches, step)  # the step's; the coming steps' planned
    records = source.next_step(student, batches, step)           # sends the weights, returns step's records
    source.save(checkpoint_folder); source.load(checkpoint_folder)   # the queued steps, at a checkpoint

How it stays exact and bounded:
- **Prompts.** Keyed sampling (`engines.rollout_seeds`: seed, step, place) needs step j's prompts when step j
  is sampled. The source peeks them (`prompts`): it pulls the prompt micro-batches of the next s steps from
  the epoch's data iterator early (`PromptLookahead`) and plans each (`plan`); the steps then take them in
  order, so the data order, and which prompt sits at which place, are those of the synchronous run. An
  epoch's iterator cannot be peeked past its end: the first step of each epoch is sampled in its own step
  (staleness 0).
- **Weights.** `next_step(student, …, k)` (at the start of step k, after optimizer step k-1) sends a copy of
  the student's weights through the producer's queue (shared memory, not the disk; `weights.Weights`: each
  tensor once, a tie beside it), then the plans it was given, each message typed (`WeightsMessage`,
  `PlanMessage`, ...). The producer works through its queue in order: weights replace its
  copy's (the kit's loop) or go into the engine through vLLM's weight-update path (`VLLMEngine.load`, the
  `LLM.apply_model` + `load_weights` path the synchronous sync takes), a plan is sampled with the latest
  weights before it in the queue. So step j is sampled by the weights of step max(j - s, epoch
  start), whatever the timing: the same versions, hence the same rollouts, in every run.
- **Bound.** The trainer plans at most s steps beyond the one it trains, and the producer samples only what
  was planned: it never runs more than s steps ahead.
- **Sampling log-probs.** The producer's engine reports each sampled token's log-probability: the kit's
  loop as it decodes (`HFEngine(logprobs=True)`: log-softmax at temperature 1 of the raw logits, over the
  whole head), vLLM its own (`logprobs_mode="raw_logprobs"`, the same quantity): the trainer's importance
  ratio reads them (`async_correction`), `policy_version` which weights.
- **Sampler gap.** The weights that sampled the step being trained stay kept until the next step
  (`weights_of`): the trainer measures the engine's log-probs against them (`weights.logprobs_under`), so
  a producer that samples with other weights than it was sent shows, and in the first steps stops the run.
- **Failure.** A producer that raises (a vLLM engine that cannot start among them) sends its error; one that
  dies is noticed while the trainer waits; either stops the run with one line (`RolloutProducerDied`).
- **Resume.** The source keeps the weights of the versions its queued steps still need (at most s); a
  checkpoint stores them with each queued step's version (`save`: `save_queued`, `QUEUED_FILE`, ties
  included), and a resumed source (`load`: `load_queued`, `resume`) hands the producer those steps after
  those weights before anything else: the resumed run samples what the unbroken one did (the prompts come
  from the resumed data iterator, the same).
- **Episodes.** With `loop` a multi-turn source (`multiturn.MultiTurnRollouts`, given its environment and
  tokenizer, both pickled into the producer as the engine factory is), the producer plays each planned step's
  episodes against its own copy of the environment, every turn keyed as the synchronous source keys it
  (`engines.rollout_seeds`, `multiturn.turn_seeds`): the same versions give the same episodes. Their
  `counts` come back with the records, and `step_metrics` derives the trainer's `tool/` columns from them
  as the synchronous source does (through `mirror`, the same source built here and never opened).
- **Processes.** Under DDP each training process has its own source and producer (`rank`, `world`): it
  samples that process's rows of the step's global batch, keyed by their places, so the rows are those of
  the one-process run. A sharded student (FSDP) is refused: a producer needs the whole weights.
- **Placement.** The producer runs on `rollout_device` (a GPU of its own, `cuda:1`, or the trainer's device);
  the memory plan counts it there and its queue in host memory (`memory.components`).

Not yet: weights to a vLLM producer on the same GPU through CUDA IPC or NCCL (`collective_rpc`, vLLM's weight
transfer engine) instead of a copy through the CPU.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from opdkit.config import ConfigError, RunFailure, one_line
from opdkit.rollout import engines
from opdkit.rollout.source import EngineRollouts, RolloutRecord, RolloutSource
from opdkit.rollout.weights import Weights
from opdkit.run.files import atomic_path

POLL_S = 0.2  # how often a waiting trainer checks that the producer is alive
ORPHAN_POLL_S = 5.0  # how often an idle producer checks that its trainer is alive
STOP_S = 10.0  # how long a closing source waits for its producer before terminating it
READ_FAILED_WAIT_S = 2.0  # how long an unreadable message waits for its producer's exit to show
QUEUED_FILE = "rollouts_ahead.safetensors"  # a checkpoint's queued steps and the weights that sample them
REASON_CHARS = 600  # a producer's error at most this long in the trainer's line (vLLM's can run to 10 KB)


class RolloutProducerDied(RunFailure, RuntimeError):
    """The process sampling rollouts ahead failed or exited: the run cannot get its next rollouts."""


class PromptLookahead:
    """The prompt micro-batches of the coming steps, pulled early from the epoch's data iterator in the order
    the trainer would have pulled them (`num_batches` per step, as `Trainer.get_batch_samples`); a new
    iterator (a new epoch) starts afresh."""

    def __init__(self, depth: int):
        self.depth = depth
        self._it: Iterator | None = None
        self._queued: collections.deque[list[dict]] = collections.deque()
        self._ended = False

    def take(self, epoch_iterator: Iterator, num_batches: int, step: int) -> tuple[list, list[tuple]]:
        """(step's prompt micro-batches, [(coming step, its micro-batches), …] newly pulled, at most
        `depth` steps beyond `step` in all)."""
        if epoch_iterator is not self._it:
            self._it, self._queued, self._ended = epoch_iterator, collections.deque(), False
        now = self._queued.popleft() if self._queued else self._pull(num_batches)
        new = []
        while len(self._queued) < self.depth and not self._ended:
            later = self._pull(num_batches)
            if not later:
                self._ended = True
                break
            self._queued.append(later)
            new.append((step + len(self._queued), later))
        return now, new

    def _pull(self, num_batches: int) -> list[dict]:
        out = []
        for _ in range(num_batches):
            try:
                out.append(next(self._it))
            except StopIteration:
                self._ended = True
                break
        return out


def _on(x, device):
    """A prompt batch's or a record's tensors on `device` (lists and the rest unchanged)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _on(v, device) for k, v in x.items()}
    if isinstance(x, RolloutRecord):
        return dataclasses.replace(
            x, **{f.name: _on(getattr(x, f.name), device) for f in dataclasses.fields(x)}
        )
    return x


@dataclass(frozen=True)
class WeightsMessage:
    """To the producer: the weights `version` (optimizer steps taken) replace those it samples with."""

    version: int
    weights: Weights


@dataclass(frozen=True)
class PlanMessage:
    """To the producer: sample step `step` (0-based) for these prompt micro-batches."""

    step: int
    batches: list[dict]


@dataclass(frozen=True)
class StopMessage:
    """To the producer: shut the engine down and exit."""


@dataclass(frozen=True)
class RecordsMessage:
    """From the producer: step `step`'s records, sampled by weights `version`, when it started and finished
    them (wall clock), and the producer's source's own numbers of the step (`counts`)."""

    step: int
    version: int | None
    records: list[RolloutRecord]
    started: float
    finished: float
    counts: dict[str, float] = dataclasses.field(
        default_factory=dict
    )  # the source's (`EngineRollouts.counts`)


@dataclass(frozen=True)
class ErrorMessage:
    """From the producer: why it failed (one line)."""

    reason: str


def _produce(
    trainer,
    inbox,
    outbox,
    make_engine,
    make_loop,
    config,
    settings,
    seed,
    rank,
    world,
    batch_size,
    device,
    threads,
):
    """The producer process: the trainer's engine (`make_engine`), whose weights only ever come through
    `inbox`, sampling each planned step through the source `make_loop` builds with it (single-turn or
    episodes) with the latest weights received before the plan. A producer whose
    trainer (`trainer`: its pid) is gone (killed: it could not send a stop) exits by itself instead of
    waiting for ever."""
    try:
        device = only_gpu(device)
        torch.set_num_threads(threads)  # before a vLLM engine starts (it makes the call a no-op)
        loop = make_loop(make_engine, settings, seed, rank, world, batch_size)
        policy, load = _receiver(loop.engine(), config, device)
        version = None
        while True:
            try:
                msg = inbox.get(timeout=ORPHAN_POLL_S)
            except queue.Empty:
                if os.getppid() != trainer:  # re-parented: the trainer died (maybe while this one started)
                    return
                continue
            if isinstance(msg, StopMessage):
                loop.close()  # a vLLM engine shut down, not left to the process's exit
                return
            if isinstance(msg, WeightsMessage):
                version = msg.version
                load(msg.weights)
                continue
            started = time.time()
            records = loop.sampled(policy, _on(msg.batches, device), msg.step)
            records = [dataclasses.replace(r, policy_version=version) for r in records]
            finished = time.time()
            outbox.put(
                RecordsMessage(msg.step, version, _on(records, "cpu"), started, finished, dict(loop.counts))
            )
    except BaseException as e:  # noqa: BLE001 (sent to the trainer, which stops the run with it)
        reason = f"{type(e).__name__}: {one_line(e)}"
        outbox.put(ErrorMessage(reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + " …"))


def only_gpu(device: str) -> str:
    """In a producer on `cuda:N`, before anything touches CUDA: this process sees that GPU alone
    (`CUDA_VISIBLE_DEVICES`, the N-th of those the trainer sees), as `cuda:0`. A vLLM engine places itself on
    the first GPU it sees; the kit's loop follows the device it is given: both on the GPU named."""
    kind, _, index = device.partition(":")
    if kind != "cuda" or not index:
        return device
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = seen.split(",") if seen else [str(i) for i in range(int(index) + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = seen[int(index)].strip()
    return "cuda:0"


def _receiver(engine, config, device) -> tuple[torch.nn.Module | None, Callable[[Weights], None]]:
    """(what `engine` samples with, how received weights reach it). The kit's loop: a copy of the student
    built from its config, the weights loaded into it (a tie restored: both names). vLLM: the engine started
    now (tens of seconds, while the trainer gets ready; a failure is the run's first message) and each
    tensor fed once to its weight-update path (`VLLMEngine.load`), cast to the engine's dtype as it is
    drawn."""
    if engine.name == "vllm":
        _ = engine.llm  # built now
        dtype = getattr(torch, engine.dtype)
        return None, lambda w: engine.load((k, v.to(device, dtype)) for k, v in w.each())
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    model.requires_grad_(False)
    return model, lambda w: model.load_state_dict(w.on(device).state())


def check_settings(s, sharded: bool, dry_run: bool = False) -> None:
    """What sampling ahead (`rollout_ahead` >= 1) needs beyond its settings alone (`OPDSettings.normalise`):
    an unsharded student, a producer GPU this process sees, an engine that can run here; each failure one
    line. Run by a job before its run folder is written and by `build.rollout_source`. A dry run, which
    plans for another machine, only notes a GPU it does not see."""
    if not s.rollout_ahead:
        return
    if sharded:
        raise ConfigError(
            f"rollout_ahead={s.rollout_ahead} sends each process's producer the whole student, and a "
            "sharded student (parallelism fsdp) holds a part of it in each process: use parallelism "
            "ddp, or rollout_ahead 0."
        )
    device = s.rollout_device
    gpu = int(device.partition(":")[2] or 0) if device.startswith("cuda") else -1
    if gpu >= torch.cuda.device_count():
        line = (
            f"rollout_device={device} places the rollout producer on a GPU this process does not see "
            f"({torch.cuda.device_count()} visible)"
        )
        if dry_run:
            print(f"note: {line}; the run needs it", flush=True)
        else:
            raise ConfigError(
                f"{line}: name a visible one, or leave rollout_device empty for the trainer's device."
            )
    engines.check_available(s.rollout_engine, dry_run)  # here, in one line, not in the producer


class AheadRollouts(RolloutSource):
    """Rollouts sampled up to `ahead` steps ahead of training by a producer process (torch.multiprocessing,
    spawn) running the engine `make_engine` builds (picklable: the trainer's factory): the kit's loop on its
    own copy of the student (`config`: the student's config), or a vLLM engine started from the student's
    folder; either way the weights come from the trainer, step by step, on `rollout_device` (None: `device`,
    the trainer's, where the records are handed over). Each record carries the weights' version that sampled
    it and their log-probabilities of its tokens, computed in `dtype` (the engine's). `loop` is the
    synchronous source the producer samples through, called there as `loop(make_engine, settings, seed,
    rank, world, batch_size)` (picklable: `EngineRollouts`, or a `functools.partial` of
    `multiturn.MultiTurnRollouts` with its environment and tokenizer, whose episodes the producer then
    plays). `timeline`: per sampled step, its version and when the producer started and finished it (wall
    clock), for tests and measurements."""

    def __init__(
        self,
        make_engine: Callable[[], engines.HFEngine | engines.VLLMEngine],
        config,
        settings: engines.SamplingSettings,
        seed: int,
        rank: int,
        world: int,
        batch_size: int,
        ahead: int,
        device,
        rollout_device: str | None = None,
        dtype: str = "float32",
        loop: Callable[..., EngineRollouts] = EngineRollouts,
    ):
        self.ahead, self.rank, self.dtype = ahead, rank, dtype
        self.make_engine, self.loop = make_engine, loop
        # The producer's source, built here too and never opened (no engine): `step_metrics` reads the
        # counts the producer sent (`RecordsMessage.counts`) through it.
        self.mirror = loop(make_engine, settings, seed, rank, world, batch_size)
        self.rollout_device = str(rollout_device or device)
        self._args = (
            config,
            settings,
            seed,
            rank,
            world,
            batch_size,
            self.rollout_device,
            torch.get_num_threads(),
        )
        self.device = device
        self._proc = None
        self._inbox = self._outbox = None
        self._lookahead = PromptLookahead(ahead)
        self._pending: list[tuple[int, list[dict]]] = []
        self._planned: set[int] = set()
        # What sampled the steps planned and not yet taken: each one's weights version, and those versions'
        # weights (kept until no queued step needs them: at most `ahead` versions), for a checkpoint.
        self._queued: dict[int, int] = {}
        self._kept: dict[int, Weights] = {}
        self._sent: int | None = None  # the version the producer holds (sent last)
        self._primed: dict[int, int] = {}  # a resume: steps to regenerate -> their version (`resume`)
        self._training: int | None = None  # the version that sampled the step being trained (`weights_of`)
        self.timeline: list[dict] = []

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def open(self) -> None:
        if self._proc is not None:
            return
        ctx = mp.get_context("spawn")
        self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(
            target=_produce,
            args=(os.getpid(), self._inbox, self._outbox, self.make_engine, self.loop, *self._args),
            daemon=True,
            name="opdkit-rollouts",
        )
        self._proc.start()

    def prompts(self, epoch_iterator: Iterator, num_batches: int, step: int) -> list[dict]:
        """The step's prompt micro-batches; the coming steps' are peeked (`PromptLookahead`) and planned, in
        the order the steps would take them."""
        batches, coming = self._lookahead.take(epoch_iterator, num_batches, step)
        for later, prompts in coming:
            self.plan(later, prompts)
        return batches

    def plan(self, step: int, batches: list[dict]) -> None:
        """The prompt micro-batches of a coming step, sampled early (sent with the next weights)."""
        self._pending.append((step, batches))

    def next_step(self, student: torch.nn.Module, batches: list[dict], step: int) -> list[RolloutRecord]:
        if not batches:
            return []
        self.open()
        self._training = None  # the last step's sampling weights no longer needed
        if self._primed:  # a resume: the steps a checkpoint had queued, with the weights that sampled them
            self._regenerate([(step, batches), *self._pending])
        self._send_weights(step, Weights.copy_of(student))
        if step not in self._planned:  # the first step of a run or an epoch: nothing peeked it
            self._pending.insert(0, (step, batches))
        for s, b in self._pending:
            self._send_plan(s, b)
        self._pending = []
        records = [_on(r, self.device) for r in self._records(step)]
        self._taken(step)
        return records

    def step_metrics(self, sum_over_processes: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """The producer's source's own columns of the step just returned (episodes' `tool/` columns), from
        the counts it sent with the records."""
        return self.mirror.step_metrics(sum_over_processes)

    def weights_of(self, version: int) -> Weights | None:
        """The weights of `version`, while a queued step needs them or, for the step `next_step` last
        returned, until the next `next_step`: the trainer's sampler gap (`weights.logprobs_under`) reads
        them. None when they are no longer kept."""
        return self._kept.get(version)

    def logprob_dtype(self) -> str:
        return self.dtype

    def queued(self) -> tuple[dict[int, int], dict[int, Weights]]:
        """What a checkpoint keeps to regenerate the steps planned and not yet taken: ({step: the version of
        the weights that sample it}, {version: those weights, on the CPU}). Between steps k-1 and k these are
        the steps k … k+s-1 of the epoch and the versions max(j - s, epoch start) < k of each."""
        return dict(self._queued), {v: self._kept[v] for v in sorted(set(self._queued.values()))}

    def save(self, folder: Path) -> None:
        save_queued(self, folder)

    def load(self, folder: Path) -> None:
        queued = load_queued(folder)
        if queued is None:
            if self.rank == 0:
                print(
                    f"resume: {folder} keeps no rollouts sampled ahead; its first step is sampled by the "
                    "current weights (staleness 0)",
                    flush=True,
                )
            return
        self.resume(*queued)

    def resume(self, plans: dict[int, int], weights: dict[int, Weights]) -> None:
        """Primes a resumed run with a checkpoint's `queued()`: the first step hands each queued step to the
        producer after its own weights version, as the unbroken run had, then the current weights; the steps'
        prompts are those the resumed data iterator gives (the same, in the same order)."""
        missing = sorted(set(plans.values()) - set(weights))
        if missing:
            raise ValueError(f"the queued steps' weights versions {missing} are not in the checkpoint")
        self._primed = dict(plans)
        self._kept = {v: weights[v] for v in sorted(set(plans.values()))}

    def _regenerate(self, available: list[tuple[int, list[dict]]]) -> None:
        """Sends the primed steps the resumed run has the prompts of (versions in order), then forgets the
        priming: the other queued steps (another epoch, fewer steps) are sampled as a fresh run would."""
        prompts = dict(available)
        for s in sorted(self._primed):
            if s in prompts:
                version = self._primed[s]
                if version != self._sent:
                    self._send_weights(version, self._kept[version])
                self._send_plan(s, prompts[s])
        self._pending = [(s, b) for s, b in self._pending if s not in self._planned]
        self._primed = {}
        self._forget()

    def _send_weights(self, version: int, weights: Weights) -> None:
        self._send(WeightsMessage(version, weights), version)
        self._sent, self._kept[version] = version, weights
        self._forget()

    def _send_plan(self, step: int, batches: list[dict]) -> None:
        self._send(PlanMessage(step, _on(batches, "cpu")), step)
        self._planned.add(step)
        self._queued[step] = self._sent

    def _taken(self, step: int) -> None:
        self._training = self._queued.pop(step, None)
        self._forget()

    def _forget(self) -> None:
        """Drops the kept weights no queued step needs (the version just sent stays until the next, the step
        being trained's until the next step: at most `ahead` + 1 versions, those sent through the queue)."""
        needed = set(self._queued.values()) | set(self._primed.values()) | {self._sent, self._training}
        self._kept = {v: w for v, w in self._kept.items() if v in needed}

    def _send(self, msg: WeightsMessage | PlanMessage, step: int) -> None:
        self._check_alive(f"before step {step + 1}")
        self._inbox.put(msg)

    def _records(self, step: int) -> list[RolloutRecord]:
        while True:
            try:
                msg = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive(f"while step {step + 1}'s rollouts were awaited")
                continue
            except (OSError, EOFError) as e:  # a message whose shared tensors died with the producer
                self._proc.join(READ_FAILED_WAIT_S)  # a killed producer is reaped, its exit code known
                self._check_alive(f"while step {step + 1}'s rollouts were read")
                raise RolloutProducerDied(
                    f"step {step + 1}'s rollouts could not be read from the rollout producer "
                    f"({type(e).__name__}: {one_line(e)}); the run stops."
                ) from e
            if isinstance(msg, ErrorMessage):
                raise RolloutProducerDied(
                    f"the rollout producer failed before step {step + 1}'s rollouts: {msg.reason}; the run "
                    "stops (rollout_ahead 0 samples in the training process)."
                )
            self.timeline.append(
                {"step": msg.step, "version": msg.version, "started": msg.started, "finished": msg.finished}
            )
            self._planned.discard(msg.step)
            if msg.step == step:
                self.mirror.counts = msg.counts
                return msg.records

    def _check_alive(self, when: str) -> None:
        if self._proc is not None and not self._proc.is_alive():
            raise RolloutProducerDied(
                f"the rollout producer (pid {self._proc.pid}) exited with code {self._proc.exitcode} {when}; "
                "the run stops (its last checkpoint resumes it; rollout_ahead 0 samples in the training "
                "process)."
            )

    def close(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.is_alive():
            try:
                self._inbox.put(StopMessage())
            except (OSError, ValueError):
                pass
            proc.join(STOP_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_S)
        for q in (self._inbox, self._outbox):
            q.cancel_join_thread()
            q.close()


def save_queued(source: AheadRollouts, folder: str | Path) -> Path:
    """Writes `source.queued()` into a checkpoint folder (`QUEUED_FILE`, atomically): each kept version's
    weights as tensors `<version>/<name>` (each tensor once, `Weights.flat`), the steps' versions and the
    ties in the metadata."""
    plans, weights = source.queued()
    tensors, ties = {}, {}
    for v, w in weights.items():
        t, tied = w.flat(f"{v}/")
        tensors.update(t)
        ties.update(tied)
    path = Path(folder) / QUEUED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"plans": json.dumps({str(k): v for k, v in plans.items()}), "ties": json.dumps(ties)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return path


def load_queued(folder: str | Path) -> tuple[dict[int, int], dict[int, Weights]] | None:
    """A checkpoint's queued steps and their weights (`save_queued`), ties restored, or None when it has none
    (a checkpoint of a synchronous run)."""
    path = Path(folder) / QUEUED_FILE
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    plans = {int(k): int(v) for k, v in json.loads(meta["plans"]).items()}
    tensors, ties = load_file(str(path)), json.loads(meta["ties"])
    versions = sorted({int(k.split("/", 1)[0]) for k in tensors})
    return plans, {v: Weights.unflat(tensors, ties, f"{v}/") for v in versions}
