"""Rollouts sampled ahead of training (`rollout_ahead: s`): a producer process samples the rollouts of steps
k+1 … k+s while the trainer trains step k, with the kit's loop on its own copy of the student.

    source = AheadRollouts(student.config, settings, seed=42, rank=0, world=1, batch_size=64, ahead=1)
    source.plan(step + 1, next_steps_prompt_batches)             # the trainer peeks the coming steps' prompts
    records = source.next_step(student, prompt_batches, step)    # sends the weights, returns step's records

How it stays exact and bounded:
- **Prompts.** Keyed sampling (`engines.rollout_seeds`: seed, step, place) needs step j's prompts when step j
  is sampled. The trainer peeks them: it pulls the prompt micro-batches of the next s steps from the epoch's
  data iterator early (`PromptLookahead`) and hands each to `plan`; the steps then take them in order, so the
  data order, and which prompt sits at which place, are those of the synchronous run. An epoch's iterator
  cannot be peeked past its end: the first step of each epoch is sampled in its own step (staleness 0).
- **Weights.** `next_step(student, …, k)` (at the start of step k, after optimizer step k-1) sends a copy of
  the student's state_dict through the producer's queue (shared memory, not the disk), then the plans it was
  given. The producer works through its queue in order: weights replace its copy's, a plan is sampled with
  the latest weights before it in the queue. So step j is sampled by the weights of step max(j - s, epoch
  start), whatever the timing: the same versions, hence the same rollouts, in every run.
- **Bound.** The trainer plans at most s steps beyond the one it trains, and the producer samples only what
  was planned: it never runs more than s steps ahead.
- **Behaviour log-probs.** The producer's loop keeps each sampled token's log-probability as it decodes
  (`HFEngine(logprobs=True)`: log-softmax at temperature 1 of the raw logits, over the whole head, as vLLM
  reports): the trainer's importance ratio reads them (`async_correction`), `policy_version` which weights.
- **Placement.** The producer runs on `rollout_device` (a GPU of its own, `cuda:1`, or the trainer's device);
  the memory plan counts it there and its queue in host memory (`memory.rows.producer_rows`, `queue_rows`).
- **Failure.** A producer that raises sends its error; one that dies is noticed while the trainer waits;
  either stops the run with one line (`RolloutProducerDied`).

Not yet: a vLLM producer (weights through vLLM's update path), a resume that regenerates the queued steps,
several training processes each with its producer.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import time
from collections.abc import Iterator

import torch
import torch.multiprocessing as mp

from opdkit.config import RunFailure, one_line
from opdkit.rollout import engines
from opdkit.rollout.source import EngineRollouts, RolloutRecord, RolloutSource

POLL_S = 0.2  # how often a waiting trainer checks that the producer is alive
STOP_S = 10.0  # how long a closing source waits for its producer before terminating it
READ_FAILED_WAIT_S = 2.0  # how long an unreadable message waits for its producer's exit to show


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


def _produce(inbox, outbox, config, settings, seed, rank, world, batch_size, device, threads) -> None:
    """The producer process: a copy of the student built from its config (its weights only ever come through
    `inbox`), sampling each planned step with the latest weights received before the plan."""
    try:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
        model.requires_grad_(False)
        make = lambda: engines.make_engine("hf", logprobs=True)  # noqa: E731
        loop = EngineRollouts(make, settings, seed, rank, world, batch_size)
        version = None
        while True:
            msg = inbox.get()
            if msg[0] == "stop":
                return
            if msg[0] == "weights":
                version = msg[1]
                model.load_state_dict({k: v.to(device) for k, v in msg[2].items()})
                continue
            _, step, batches = msg
            started = time.time()
            records = loop.next_step(model, _on(batches, device), step)
            records = [dataclasses.replace(r, policy_version=version) for r in records]
            outbox.put(("records", step, version, _on(records, "cpu"), started, time.time()))
    except BaseException as e:  # noqa: BLE001 (sent to the trainer, which stops the run with it)
        outbox.put(("error", f"{type(e).__name__}: {one_line(e)}"))


class AheadRollouts(RolloutSource):
    """Rollouts sampled up to `ahead` steps ahead of training by a producer process (torch.multiprocessing,
    spawn) running the kit's loop on its own copy of the student (`config`: the student's config; the
    weights come from the trainer, step by step) on `producer_device` (`rollout_device`; None: `device`, the
    trainer's, where the records are handed over). Each record carries the weights' version that sampled it
    and their log-probabilities of its tokens. `timeline`: per sampled step, its version and when the
    producer started and finished it (wall clock), for tests and measurements."""

    def __init__(
        self,
        config,
        settings: engines.SamplingSettings,
        seed,
        rank,
        world,
        batch_size,
        ahead,
        device,
        producer_device=None,
    ):
        self.ahead = ahead
        where = str(producer_device or device)
        self._args = (config, settings, seed, rank, world, batch_size, where, torch.get_num_threads())
        self.device = device
        self._proc = None
        self._inbox = self._outbox = None
        self._pending: list[tuple[int, list[dict]]] = []
        self._planned: set[int] = set()
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
            args=(self._inbox, self._outbox, *self._args),
            daemon=True,
            name="opdkit-rollouts",
        )
        self._proc.start()

    def plan(self, step: int, batches: list[dict]) -> None:
        self._pending.append((step, batches))

    def next_step(self, student: torch.nn.Module, batches: list[dict], step: int) -> list[RolloutRecord]:
        if not batches:
            return []
        self.open()
        state = {k: v.detach().to("cpu", copy=True) for k, v in student.state_dict().items()}
        self._send(("weights", step, state))
        if step not in self._planned:  # the first step of a run or an epoch: nothing peeked it
            self._pending.insert(0, (step, batches))
        for s, b in self._pending:
            self._send(("plan", s, _on(b, "cpu")))
            self._planned.add(s)
        self._pending = []
        return [_on(r, self.device) for r in self._records(step)]

    def _send(self, msg) -> None:
        self._check_alive(f"before step {msg[1] + 1}")
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
            if msg[0] == "error":
                raise RolloutProducerDied(
                    f"the rollout producer failed before step {step + 1}'s rollouts: {msg[1]}; the run stops "
                    "(rollout_ahead 0 samples in the training process)."
                )
            _, s, version, records, started, finished = msg
            self.timeline.append({"step": s, "version": version, "started": started, "finished": finished})
            self._planned.discard(s)
            if s == step:
                return records

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
                self._inbox.put(("stop",))
            except (OSError, ValueError):
                pass
            proc.join(STOP_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_S)
        for q in (self._inbox, self._outbox):
            q.cancel_join_thread()
            q.close()
