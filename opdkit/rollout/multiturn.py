"""Multi-turn rollouts: each prompt's episode played against an environment (tool calls and their results)
through the rollout engine, one record per micro-batch whose rows hold several sampled segments.

    env = CalculatorEnvironment(task)                # opdkit.tasks (built by the caller: a higher room)
    source = MultiTurnRollouts(make_engine, settings, seed=42, rank=0, world=1, batch_size=8,
                               environment=env, tokenizer=tok, max_turns=4, episode_max_tokens=256)
    records = source.next_step(student, batches, step)   # batches carry `messages`: PromptCollator(tools=...)
    source.counts                                    # the step's metrics summed: episodes, calls, turns...
    source.step_metrics(sum_over_processes)          # the trainer's tool/ columns, over all processes

A turn: every unfinished row's transcript so far goes to the engine in one call, up to
`rollout_max_new_tokens` per turn and what is left of the episode's `episode_max_tokens`, ending at a stop
token as a single-turn completion does. The kit's loop keeps the episodes' KV cache between turns
(`HFEngine.turns`, `sampling.Turns`): a turn prefills only the tokens new since the last (the end of the
student's turn, the tools' tokens), and draws what a re-read of the whole transcript would; any other engine
(vLLM) gets each transcript whole, left-padded, in `engine.sample`, its prefix cache sparing the re-read.
The environment reads the turn's text and answers (tool messages) or ends the episode (a turn without a call
is the final answer).
The environment is `opdkit.rollout.episodes.Environment` (its `step` answers a turn with a `StepResult`).
The tool messages become token ids by the chat template: the conversation is rendered with them and the
generation prompt, the student's turn stood in by a marker, and the text after the marker (less the stop
token the student sampled itself) is tokenized; what the student sampled is never tokenized again. An episode
ends at its final answer, at `max_turns` turns (the last turn's tool results are not appended: no turn would
read them), at a turn that hits its token limit without a stop token (truncated), or when a turn's tool
results would bring its tokens to `episode_max_tokens` (truncated; those results are not appended either, so a
record never holds more than `episode_max_tokens` tokens after its prompt, where a long error message would
otherwise pad its whole micro-batch past it).

Each row's record: the prompt (left-padded), then everything after it, right-padded: the student's turns
(each up to and including its stop token) with loss mask 1 and the engine's log-probabilities where it reports
them, the template's and the tools' tokens with loss mask 0, and each episode's conversation as messages
(`conversations`, which a teacher with another tokenizer renders with its own template; a last turn cut by its
token limit included). The teacher scores the whole transcript; only the student's tokens carry loss. Rows
are regrouped into micro-batches by length as `source.EngineRollouts` does; with one turn and no tools the
records are exactly EngineRollouts'. Each row samples turn t from its own
stream: turn 0's key is `engines.rollout_seeds` (seed, step, place in the step's global batch), later turns'
that key hashed with t (`turn_seeds`), so any number of processes samples the same episodes.

A step's `counts` are its episodes' metrics summed (`episodes.COUNTS`: each episode's steps', its grade's,
and the rollouts' own: the episode, its sampled turns, whether it was truncated); `step_metrics` sums them
over the processes and derives the shares the trainer logs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from opdkit.config import ConfigError
from opdkit.rollout import engines, microbatches, sampling
from opdkit.rollout.episodes import (
    CALLED_TOOL,
    CALLS,
    CORRECT,
    COUNTS,
    EPISODES,
    MALFORMED,
    TOOL_CORRECT,
    TRUNCATED,
    TURNS,
    Environment,
    Episode,
    add_metrics,
)
from opdkit.rollout.source import Conversations, EngineRollouts, RolloutRecord

TURN_MARK = "@@opdkit-student-turn@@"  # stands in for the student's turn when the template renders tools


def turn_seeds(seeds: list[int], turn: int) -> list[int]:
    """Each row's key for turn `turn`: its episode key itself at turn 0 (so one turn samples what single-turn
    sampling does), at later turns the key hashed with the turn (SplitMix64, into [0, 2^63))."""
    if turn == 0:
        return list(seeds)
    t = sampling.splitmix64(turn + sampling.GOLDEN)
    return [sampling.splitmix64(s ^ t) >> 1 for s in seeds]


@dataclasses.dataclass
class _Row:
    """One episode's tokens as they grow: the prompt, then every token after it with its loss flag and the
    engine's log-probability (0 where the student did not sample)."""

    prompt: list[int]
    episode: Episode
    after: list[int] = dataclasses.field(default_factory=list)
    loss: list[int] = dataclasses.field(default_factory=list)
    logp: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    cut_turn: str | None = None  # a last turn cut by its token limit (the environment never read it)

    def conversation(self) -> list[dict]:
        """The episode's messages, and a last turn cut by its token limit as an assistant message."""
        cut = [] if self.cut_turn is None else [{"role": "assistant", "content": self.cut_turn}]
        return [dict(m) for m in self.episode.messages] + cut

    def add(self, ids: list[int], sampled: bool, logp: list[float] | None = None) -> None:
        self.after += ids
        self.loss += [int(sampled)] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)


class MultiTurnRollouts(EngineRollouts):
    """Episodes against `environment` (an `episodes.Environment`: one of `opdkit.tasks`, built by the caller),
    sampled through the engine `make_engine` builds (`engines.make_engine`; built, synced once per optimizer
    step and closed as `EngineRollouts` does, whose `sampled` this one replaces: so a producer sampling ahead,
    `ahead.AheadRollouts`, plays episodes too). `tokenizer` renders the tool
    messages with its chat template (`enable_thinking` passed on); `max_turns` student turns at most per
    episode; `episode_max_tokens` tokens after the prompt at most (0: no limit but the turns')."""

    def __init__(
        self,
        make_engine: Callable[[], engines.HFEngine | engines.VLLMEngine],
        settings: engines.SamplingSettings,
        seed: int,
        rank: int,
        world: int,
        batch_size: int,
        *,
        environment: Environment,
        tokenizer: Any,
        max_turns: int,
        episode_max_tokens: int = 0,
        enable_thinking: bool = False,
    ):
        if max_turns < 1:
            raise ConfigError(f"max_turns={max_turns}; an episode has at least one turn.")
        super().__init__(make_engine, settings, seed, rank, world, batch_size)
        self.environment, self.tokenizer = environment, tokenizer
        self.max_turns, self.episode_max_tokens = max_turns, episode_max_tokens
        self.enable_thinking = enable_thinking
        self.counts: dict[str, float] = dict.fromkeys(COUNTS, 0.0)

    def sampled(self, student: torch.nn.Module | None, batches: list[dict], step: int) -> list[RolloutRecord]:
        """The step's episodes played through the engine as it is (`next_step`, `EngineRollouts`', syncs it
        first; a producer sampling ahead loads the weights it was sent), and their `counts`."""
        self.counts = dict.fromkeys(COUNTS, 0.0)
        if not batches:
            return []
        if any("messages" not in b for b in batches):
            raise ConfigError(
                "multi-turn rollouts need each prompt's conversation: batch the prompts with "
                "PromptCollator(..., tools=environment.tools), which keeps `messages`."
            )
        engine = self.engine()
        s = self.settings
        ids_BP, mask_BP = microbatches.concat_prompts(batches, s.pad_token_id)
        device = ids_BP.device
        sizes = [b["prompts"].shape[0] for b in batches]
        places = microbatches.global_places(sizes, self.rank, self.world, self.batch_size)
        keys = engines.rollout_seeds(self.seed, step, places)
        answers = [a for b, n in zip(batches, sizes) for a in (b.get("answers") or [None] * n)]
        owners = [t for b, n in zip(batches, sizes) for t in (b.get("teacher_id") or [None] * n)]
        messages = [m for b in batches for m in b["messages"]]
        rows = [
            _Row(prompt=ids_BP[i][mask_BP[i].bool()].tolist(), episode=self.environment.start(m, a))
            for i, (m, a) in enumerate(zip(messages, answers))
        ]
        logprobs = self._play(engine, student, rows, keys, device)
        for row in rows:
            add_metrics(self.counts, {EPISODES: 1, TURNS: row.turns, TRUNCATED: row.truncated})
            add_metrics(self.counts, row.episode.metrics)
            add_metrics(self.counts, self.environment.grade(row.episode))
        # Shortest first (stable), as EngineRollouts orders by completion length, then cut into the
        # micro-batches' sizes, each trimmed to its own rows.
        order = torch.argsort(torch.tensor([len(r.after) for r in rows]), stable=True).tolist()
        routed = any(t is not None for t in owners)
        records, start = [], 0
        for n in sizes:
            part = order[start : start + n]
            start += n
            records.append(
                self._record(
                    [rows[i] for i in part],
                    part,
                    [answers[i] for i in part],
                    [owners[i] for i in part] if routed else None,
                    logprobs,
                    device,
                )
            )
        return records

    def _play(self, engine, student, rows: list[_Row], keys: list[int], device) -> bool:
        """Every episode to its end, one engine call per turn for the rows still playing; whether the engine
        reported log-probabilities."""
        s, stops = self.settings, set(self.settings.eos_token_ids)
        cached = engine.turns(student, s) if isinstance(engine, engines.HFEngine) else None
        logprobs = False
        for turn in range(self.max_turns):
            live = [i for i, r in enumerate(rows) if not r.done]
            if not live:
                break
            limit = {i: self._turn_limit(rows[i]) for i in live}
            contexts = [rows[i].prompt + rows[i].after for i in live]
            turn_settings = dataclasses.replace(s, max_new_tokens=max(limit.values()))
            seeds = turn_seeds([keys[i] for i in live], turn)
            if cached is not None:  # the kit's loop: only the tokens new since the last turn are read
                r = cached.sample(live, contexts, turn_settings.max_new_tokens, seeds, device)
            else:  # another engine reads each whole transcript (vLLM: its prefix cache spares the re-read)
                ctx_BT, ctx_mask_BT = sampling.left_pad(contexts, s.pad_token_id, device)
                r = engine.sample(student, ctx_BT, ctx_mask_BT, turn_settings, seeds)
            logprobs = r.logprobs_BC is not None
            ids_BC, mask_BC = r.completion_ids_BC.tolist(), r.completion_mask_BC.tolist()
            lp_BC = r.logprobs_BC.tolist() if logprobs else None
            for k, i in enumerate(live):
                row = rows[i]
                n = min(sum(mask_BC[k]), limit[i])
                ids = ids_BC[k][:n]
                row.add(ids, sampled=True, logp=lp_BC[k][:n] if logprobs else None)
                row.turns += 1
                stopped = bool(ids) and ids[-1] in stops
                if not stopped:  # the turn's token limit came first: the episode ends unfinished
                    row.done = row.truncated = True
                    row.cut_turn = self.tokenizer.decode(ids, skip_special_tokens=False)
                    continue
                text = self.tokenizer.decode(ids[:-1], skip_special_tokens=False)
                result = self.environment.step(row.episode, text)
                if result.done or turn == self.max_turns - 1:
                    row.done = True
                    continue
                tool = self.tool_ids(row.episode.messages, len(result.messages), ids[-1])
                if self.episode_max_tokens and len(row.after) + len(tool) >= self.episode_max_tokens:
                    # no turn is left to read the results: not appended, so the record keeps to the budget
                    row.done = row.truncated = True
                    continue
                row.add(tool, sampled=False)
        return logprobs

    def _turn_limit(self, row: _Row) -> int:
        """Tokens the row's next turn may take: the per-turn limit, within what is left of the episode's."""
        if not self.episode_max_tokens:
            return self.settings.max_new_tokens
        return max(1, min(self.settings.max_new_tokens, self.episode_max_tokens - len(row.after)))

    def tool_ids(self, messages: list[dict], n_tools: int, stop_id: int) -> list[int]:
        """The token ids that follow the student's last turn (which ended at `stop_id`) in the conversation
        `messages` (ending with that turn and its `n_tools` tool messages): the chat template's text after the
        turn, through the tool messages and the next generation prompt, tokenized."""
        turn = len(messages) - n_tools - 1
        if turn < 0 or messages[turn].get("role") != "assistant":
            raise ValueError(
                "tool_ids: the conversation must end with an assistant turn and its tool messages"
            )
        marked = [*messages[:turn], {**messages[turn], "content": TURN_MARK}, *messages[turn + 1 :]]
        text = self.tokenizer.apply_chat_template(
            marked,
            tools=self.environment.tools or None,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=self.enable_thinking,
        )
        at = text.rfind(TURN_MARK)
        if at < 0:
            raise ConfigError(
                "the chat template does not render an assistant turn's content as it is: multi-turn rollouts "
                "cannot place the tool results after the student's turn."
            )
        after = text[at + len(TURN_MARK) :]
        stop_text = self.tokenizer.decode([stop_id], skip_special_tokens=False)
        if stop_text and after.startswith(stop_text):  # the stop token the student sampled itself
            after = after[len(stop_text) :]
        return list(self.tokenizer(after, add_special_tokens=False)["input_ids"])

    def _record(self, rows: list[_Row], places, answers, owners, logprobs: bool, device) -> RolloutRecord:
        """Rows as one micro-batch: prompts left-padded to the widest, what follows right-padded to the
        longest (at least one column)."""
        pad = self.settings.pad_token_id
        P = max(len(r.prompt) for r in rows)
        C = max(1, max(len(r.after) for r in rows))
        B = len(rows)
        ids_BT = torch.full((B, P + C), pad, dtype=torch.long)
        attn_BT = torch.zeros((B, P + C), dtype=torch.long)
        loss_BT = torch.zeros((B, P + C), dtype=torch.long)
        logp_BT = torch.zeros((B, P + C), dtype=torch.float32)
        for b, r in enumerate(rows):
            p, c = len(r.prompt), len(r.after)
            ids_BT[b, P - p : P] = torch.tensor(r.prompt, dtype=torch.long)
            attn_BT[b, P - p : P + c] = 1
            if c:
                ids_BT[b, P : P + c] = torch.tensor(r.after, dtype=torch.long)
                loss_BT[b, P : P + c] = torch.tensor(r.loss, dtype=torch.long)
                logp_BT[b, P : P + c] = torch.tensor(r.logp, dtype=torch.float32)
        return RolloutRecord(
            input_ids_BT=ids_BT.to(device),
            attention_mask_BT=attn_BT.to(device),
            loss_mask_BT=loss_BT.to(device),
            truncated_B=torch.tensor([r.truncated for r in rows], dtype=torch.bool, device=device),
            sampled_as=list(places),
            answers=answers,
            teacher_ids=owners,
            sampling_logprobs_BT=logp_BT.to(device) if logprobs else None,
            conversations=Conversations(
                [r.conversation() for r in rows], self.environment.tools or None, self.enable_thinking
            ),
        )

    def step_metrics(self, sum_over_processes: Callable[[torch.Tensor], torch.Tensor]) -> dict:
        """The step's own columns of metrics.jsonl: its `counts` summed over the processes
        (`sum_over_processes`, the trainer's) as the share of episodes that called a tool and that called the
        tools correctly, tool calls per episode, malformed calls (count and share of the calls), turns per
        episode, and the share graded correct by the environment."""
        sums = sum_over_processes(torch.tensor([float(self.counts[k]) for k in COUNTS], dtype=torch.float64))
        c = dict(zip(COUNTS, sums.tolist()))
        episodes, calls = max(c[EPISODES], 1.0), c[CALLS]
        return {
            "tool/episodes": c[EPISODES],
            "tool/called_share": c[CALLED_TOOL] / episodes,
            "tool/call_correct_share": c[TOOL_CORRECT] / episodes,
            "tool/calls_per_episode": calls / episodes,
            "tool/malformed": c[MALFORMED],
            "tool/malformed_share": c[MALFORMED] / calls if calls else None,
            "tool/turns_mean": c[TURNS] / episodes,
            "tool/accuracy": c[CORRECT] / episodes,
        }
