"""Prompts in, sampled completions out: the on-policy half of distillation.

Pitfalls this module exists for:
- prompts are left-padded, so a plain forward (positions 0..T-1) would shift every position of a
  padded row relative to `generate`; re-scoring uses `position_ids_from_mask`, as `generate` does;
- the completion ends at the first EOS *inclusive*; when pad == eos (Qwen's base models), the padding
  after it must not count, which is why the mask is built from the first EOS, not from `!= pad`;
- `model.generate` mixes the checkpoint's `generation_config` into sampling (top_k=50 by default,
  repetition penalties, ...), which would make "on-policy" samples come from another distribution;
  `sample` is a plain KV-cached decoding loop that applies only what it is asked to;
- one random stream for a whole batch makes a row's tokens depend on which other rows share its batch (and
  on how many processes split the prompts): with `row_seeds_B` each row draws from its own counter-based
  stream instead (`keyed_draw`: the n-th uniform of a row is a hash of its seed and n, turned into a token by
  the inverse of its own distribution's CDF), so a row's completion depends on its seed and its own logits
  alone;
- a multi-turn episode's next turn would re-read its whole transcript to sample a few tokens: `Turns` keeps
  the batch's KV cache between turns and prefills only each row's new tokens, placed so that positions,
  masks and draws are those of the whole transcript left-padded.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # its module imports much of torch (about 4 s): not for a plan


@dataclass
class Rollout:
    """A batch of prompts with their sampled completions (B rows, P prompt + C completion columns)."""

    input_ids_BT: torch.Tensor  # prompt (left-padded) followed by completion (right-padded)
    attention_mask_BT: torch.Tensor  # 1 on real prompt tokens and on completion tokens up to EOS
    completion_mask_BC: torch.Tensor  # 1 on completion tokens up to and including the first EOS
    prompt_len: int  # P: columns that hold the (padded) prompt
    logprobs_BC: torch.Tensor | None = (
        None  # an engine's log p of each sampled token (raw, T = 1), 0 elsewhere
    )

    @property
    def completion_ids_BC(self) -> torch.Tensor:
        return self.input_ids_BT[:, self.prompt_len :]

    @property
    def position_ids_BT(self) -> torch.Tensor:
        return position_ids_from_mask(self.attention_mask_BT)

    def truncated_B(self, eos_token_id: int | list[int]) -> torch.Tensor:
        """True where the completion never produced an EOS."""
        return ~_is_eos(self.completion_ids_BC, eos_token_id).any(dim=1)

    def rows(self, index_B: torch.Tensor) -> Rollout:
        """The rows at `index_B`, in that order; columns unchanged."""
        return Rollout(
            input_ids_BT=self.input_ids_BT[index_B],
            attention_mask_BT=self.attention_mask_BT[index_B],
            completion_mask_BC=self.completion_mask_BC[index_B],
            prompt_len=self.prompt_len,
            logprobs_BC=None if self.logprobs_BC is None else self.logprobs_BC[index_B],
        )


def _is_eos(ids: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    eos = torch.as_tensor(eos_token_id, device=ids.device).reshape(-1)
    return torch.isin(ids, eos)


def completion_mask(completion_ids_BC: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 on tokens up to and including the first EOS of each row, 0 after it (also when pad == eos)."""
    is_eos = _is_eos(completion_ids_BC, eos_token_id).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before each position
    return (eos_before == 0).long()


def position_ids_from_mask(attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Positions as `generate` assigns them under left padding: count of real tokens before, minus 1."""
    pos = attention_mask_BT.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[list[dict]],
    enable_thinking: bool = False,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat-template each conversation with the generation prompt; left-pad into (ids, mask)."""
    ids = [
        list(
            tokenizer.apply_chat_template(
                m,
                tokenize=True,
                add_generation_prompt=True,
                enable_thinking=enable_thinking,
                return_dict=True,
            )["input_ids"]
        )
        for m in messages
    ]
    return left_pad(ids, tokenizer.pad_token_id, device)


def left_pad(
    ids: list[list[int]], pad_token_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists as one batch, right-aligned: (ids_BT, mask_BT), padding on the left."""
    lengths_B = torch.tensor([len(x) for x in ids], dtype=torch.long)
    width = int(lengths_B.max())
    mask_BT = (torch.arange(width)[None] >= width - lengths_B[:, None]).long()
    out_BT = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    # one copy of all the ids (numpy reads a Python iterable ~7x faster than torch.tensor), row by row
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths_B.sum()))
    out_BT[mask_BT.bool()] = torch.from_numpy(flat)
    return out_BT.to(device), mask_BT.to(device)


def warpers(temperature: float, top_p: float, top_k: int = 0) -> list[LogitsProcessor]:
    """Temperature, then top-k, then top-p (transformers' own warpers, in `generate`'s order); nothing for
    T = 1, top-k = 0 (off), top-p = 1."""
    out: list[LogitsProcessor] = []
    if temperature > 0 and temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


def sample(
    model: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    do_sample: bool = True,
    synced_gpus: bool = False,
    logits_processor: list | None = None,
    row_seeds_B: torch.Tensor | list[int] | None = None,
    keep_logprobs: bool = False,
) -> Rollout:
    """Sample completions token by token with the model's KV cache (also under gradient checkpointing).

    The next token is drawn from softmax(processed logits): `logits_processor` (if any), then temperature
    and top-p; `do_sample=False` takes the argmax instead. Nothing else touches the distribution: unlike
    `model.generate`, no top-k, repetition penalty or other setting from the checkpoint's
    `generation_config` sneaks in, so on-policy samples really come from the policy. For the same seed
    the tokens are those of `generate(..., top_k=0)` on a model without such settings (tested), at less
    per-token overhead. `synced_gpus=True` keeps every rank calling the model until all ranks are done,
    so ranks whose completions end early do not leave a sharded (FSDP) model waiting in a collective.

    Randomness: torch's global generator (seed it first) draws the whole batch at once; with `row_seeds_B`
    (one int64 seed per row) every row draws from its own stream (`keyed_draw`) and the global generator is
    left alone, so a row samples the same tokens whatever else is in its batch.

    `keep_logprobs`: also the log-probability of each sampled token under the raw logits (temperature 1,
    the whole head, before any processor), as vLLM reports it, in `Rollout.logprobs_BC`.
    """
    with _evaluating(model):
        out_BT, logprobs_BC, _ = _decode(
            model,
            prompt_ids_BP,
            prompt_ids_BP,
            position_ids_from_mask(prompt_mask_BP),
            prompt_mask_BP,
            DynamicCache(config=model.config),
            eos_token_id,
            pad_token_id,
            max_new_tokens,
            list(logits_processor or []) + (warpers(temperature, top_p) if do_sample else []),
            do_sample,
            synced_gpus,
            None if row_seeds_B is None else torch.as_tensor(row_seeds_B, dtype=torch.int64),
            keep_logprobs,
        )
    return _rollout(prompt_ids_BP, prompt_mask_BP, out_BT, logprobs_BC, eos_token_id, pad_token_id)


class Turns:
    """The kit's loop over a batch of multi-turn episodes with the KV cache kept between their turns: each
    turn prefills only the tokens a row's transcript gained since the cache last saw it (the end of the turn
    it sampled, the tools' tokens), then samples on, so a turn costs what its new tokens cost, not a re-read
    of the whole transcript (tinker's "sequence extension"; vLLM's prefix caching does the same for it).

        turns = Turns(model, eos_token_id=..., pad_token_id=..., temperature=1.0)
        r = turns.sample(rows, transcripts, max_new_tokens, seeds)   # a `Rollout`, as `sample` returns

    `rows` names each transcript's episode (ints, its place among the batch's episodes); a call's rows are
    those of the previous call or fewer (finished episodes leave; their cache rows are dropped), each
    transcript the previous one extended. The tokens drawn are those `sample` draws on the whole transcript
    left-padded (the same positions, from the mask; the same per-row streams `keyed_draw(logits, seeds,
    index)`, the index counted from 0 in each call), and so is the returned `Rollout` (the transcripts
    left-padded, then the completions); the log-probabilities agree to float32 rounding (the keys and values
    of earlier tokens come from other forwards: another order of summation).

    The cache keeps one batch: a call feeds each row's new tokens right-aligned, the columns before them
    masked, so every row's last token is the last column and a real token's position is the number of real
    tokens before it, as in the whole transcript. Columns a row did not keep (the padding sampled after its
    stop token, a turn's tokens past its row's limit) stay in the cache, masked. The sampled tokens after
    the last fed one (the loop never feeds the token it samples last) are fed with the next call's."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_id: int | list[int],
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        do_sample: bool = True,
        synced_gpus: bool = False,
        keep_logprobs: bool = False,
    ):
        self.model, self.eos_token_id, self.pad_token_id = model, eos_token_id, pad_token_id
        self.processors = warpers(temperature, top_p) if do_sample else []
        self.do_sample, self.synced, self.keep_logprobs = do_sample, synced_gpus, keep_logprobs
        self.cache: DynamicCache | None = None
        self.rows: list[int] = []  # the episode of each cache row
        self.fed: list[list[int]] = []  # each cache row's tokens the cache holds, in order
        self.mask_BK: torch.Tensor | None = None  # 1 on the cache columns each row keeps

    def sample(
        self,
        rows: list[int],
        transcripts: list[list[int]],
        max_new_tokens: int,
        row_seeds_B: torch.Tensor | list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> Rollout:
        """Up to `max_new_tokens` tokens after each row's transcript, as `sample` draws them."""
        ctx_BT, ctx_mask_BT = left_pad(transcripts, self.pad_token_id, device)
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
            self.mask_BK = ctx_mask_BT[:, :0]
            self.fed = [[] for _ in rows]
        else:
            self._keep(rows)
        new = []
        for k, ids in enumerate(transcripts):
            fed = self.fed[k]
            if ids[: len(fed)] != fed:
                raise ValueError(
                    f"Turns.sample: row {rows[k]}'s transcript does not extend the one its cache holds; "
                    "each call must pass every episode's whole transcript so far (or start a new Turns)."
                )
            if len(fed) == len(ids):  # nothing new: feed its last token again, its old column masked
                self.mask_BK[k, self._last_kept(k)] = 0
                fed.pop()
            new.append(ids[len(fed) :])
        self.rows = list(rows)
        new_BN, new_mask_BN = left_pad(new, self.pad_token_id, device)
        K = self.mask_BK.shape[1]
        mask_BT = torch.cat([self.mask_BK, new_mask_BN], dim=1)
        with _evaluating(self.model):
            out_BT, logprobs_BC, mask_BT = _decode(
                self.model,
                ctx_BT,
                new_BN,
                position_ids_from_mask(mask_BT)[:, K:],
                mask_BT,
                self.cache,
                self.eos_token_id,
                self.pad_token_id,
                max_new_tokens,
                self.processors,
                self.do_sample,
                self.synced,
                None if row_seeds_B is None else torch.as_tensor(row_seeds_B, dtype=torch.int64),
                self.keep_logprobs,
            )
        r = _rollout(ctx_BT, ctx_mask_BT, out_BT, logprobs_BC, self.eos_token_id, self.pad_token_id)
        # The decoded columns: column j holds the token sampled j-th, for j below the tokens sampled less
        # the last (never fed); kept where the row's completion reaches it.
        steps = out_BT.shape[1] - ctx_BT.shape[1]
        kept_B = r.completion_mask_BC.sum(dim=1).clamp(max=steps - 1)
        cols_BD = torch.arange(mask_BT.shape[1] - K - new_BN.shape[1], device=mask_BT.device)
        decoded_BD = (cols_BD[None] < kept_B[:, None]).long()
        self.mask_BK = torch.cat([mask_BT[:, : K + new_BN.shape[1]], decoded_BD], dim=1)
        completions = r.completion_ids_BC.tolist()
        for k, ids in enumerate(new):
            self.fed[k] += ids + completions[k][: int(kept_B[k])]
        return r

    def _keep(self, rows: list[int]) -> None:
        """Drop the cache rows of the episodes not in `rows` (which must keep their order)."""
        if rows == self.rows:
            return
        at = {r: k for k, r in enumerate(self.rows)}
        if any(r not in at for r in rows) or rows != sorted(rows, key=at.__getitem__):
            raise ValueError(
                f"Turns.sample: rows {rows} are not the previous call's {self.rows} or some of them in order."
            )
        index = [at[r] for r in rows]
        self.cache.batch_select_indices(torch.tensor(index, device=self.mask_BK.device))
        self.mask_BK = self.mask_BK[index]
        self.fed = [self.fed[k] for k in index]

    def _last_kept(self, k: int) -> int:
        return int(self.mask_BK[k].nonzero()[-1])


@contextlib.contextmanager
def _evaluating(model):
    """The model in eval mode within the block (no dropout while sampling), its own mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _rollout(prompt_ids_BP, prompt_mask_BP, out_BT, logprobs_BC, eos_token_id, pad_token_id) -> Rollout:
    prompt_len = prompt_ids_BP.shape[1]
    comp_mask = completion_mask(out_BT[:, prompt_len:], eos_token_id)
    # Positions past the first EOS become padding, so pad == eos cannot leak into the completion.
    completion = torch.where(comp_mask.bool(), out_BT[:, prompt_len:], pad_token_id)
    return Rollout(
        input_ids_BT=torch.cat([prompt_ids_BP, completion], dim=1),
        attention_mask_BT=torch.cat([prompt_mask_BP, comp_mask], dim=1),
        completion_mask_BC=comp_mask,
        prompt_len=prompt_len,
        logprobs_BC=None if logprobs_BC is None else logprobs_BC * comp_mask,
    )


@torch.no_grad()
def _decode(
    model,
    seq_BT,
    step_ids,
    step_pos,
    mask_BT,
    cache,
    eos_token_id,
    pad_token_id,
    max_new_tokens,
    processors,
    do_sample,
    synced,
    seeds_B,
    keep_logprobs=False,
):
    """`seq_BT` (what the processors read) followed by up to `max_new_tokens` tokens (rows that ended continue
    with padding until all rows end), with `keep_logprobs` each new token's raw log-probability (None
    without), and the attention mask of the columns `cache` holds at the end. The first forward feeds
    `step_ids` at `step_pos` under `mask_BT` (the cache's columns and theirs) after what `cache` holds."""
    if seeds_B is not None:
        seeds_B = seeds_B.to(seq_BT.device)
    cache = {cache_kwarg(model): cache}
    done_B = torch.zeros(seq_BT.shape[0], dtype=torch.bool, device=seq_BT.device)
    logprobs = []
    for i in range(max_new_tokens):
        logits_BV = (
            model(
                input_ids=step_ids,
                attention_mask=mask_BT,
                position_ids=step_pos,
                **cache,
                use_cache=True,
                logits_to_keep=1,
            )
            .logits[:, -1, :]
            .float()
        )
        if not done_B.all():  # (all done here only under `synced`: this rank keeps the others company)
            raw_logp_BV = torch.log_softmax(logits_BV, dim=-1) if keep_logprobs else None
            for proc in processors:
                logits_BV = proc(seq_BT, logits_BV)
            if do_sample and seeds_B is not None:
                next_B = keyed_draw(logits_BV, seeds_B, i)
            elif do_sample:
                next_B = torch.multinomial(torch.softmax(logits_BV, dim=-1), num_samples=1).squeeze(1)
            else:
                next_B = logits_BV.argmax(dim=-1)
            next_B = torch.where(done_B, pad_token_id, next_B)
            if keep_logprobs:
                logprobs.append(raw_logp_BV.gather(-1, next_B[:, None])[:, 0])
            seq_BT = torch.cat([seq_BT, next_B[:, None]], dim=1)
            done_B = done_B | _is_eos(next_B, eos_token_id)
        if i == max_new_tokens - 1 or not _anyone_running(done_B, synced):
            break
        mask_BT = torch.cat([mask_BT, mask_BT.new_ones(mask_BT.shape[0], 1)], dim=1)
        step_ids, step_pos = seq_BT[:, -1:], step_pos[:, -1:] + 1
    return seq_BT, torch.stack(logprobs, dim=1) if keep_logprobs else None, mask_BT


# SplitMix64 (Steele, Lea and Flood, 2014): the n-th output of the stream seeded by s is mix(s + n x GOLDEN).
# In torch's int64 arithmetic, which wraps as uint64 does; a right shift of a negative int64 copies the sign
# bit, so `_shift_right` masks it back to a logical shift.
GOLDEN = 0x9E3779B97F4A7C15
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def as_int64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x_B: torch.Tensor, bits: int) -> torch.Tensor:
    return (x_B >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x_B: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (bit for bit the uint64 function, `splitmix64` in Python)."""
    x_B = (x_B ^ _shift_right(x_B, 30)) * as_int64(_MIX[0])
    x_B = (x_B ^ _shift_right(x_B, 27)) * as_int64(_MIX[1])
    return x_B ^ _shift_right(x_B, 31)


def splitmix64(x: int) -> int:
    """The same finaliser on a Python int (uint64 arithmetic): what `rollout_seeds` hashes keys with."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX[0]) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX[1]) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seeds_B: torch.Tensor, index: int) -> torch.Tensor:
    """The `index`-th uniform in (0, 1) of each row's stream (float64, 53 random bits): a function of the
    row's seed and `index` alone."""
    state_B = seeds_B + as_int64((index + 1) * GOLDEN)
    return (_shift_right(mix64(state_B), 11).double() + 0.5) * 2.0**-53


def keyed_draw(logits_BV: torch.Tensor, seeds_B: torch.Tensor, index: int) -> torch.Tensor:
    """One token per row from softmax(logits_BV) (processed logits: -inf where a warper removed a token),
    by the inverse of the row's CDF at its `index`-th uniform u: the first token whose cumulative weight
    reaches u x the row's total, so token j is drawn with probability w_j / total. Exact up to rounding
    (fp32 weights, their cumulative sum in float64: 12 B per row and token beside the logits); a removed
    token (zero weight, no step of the CDF) is never drawn, and u < 1 keeps the target within the total (a
    cumulative sum of non-negative terms never decreases)."""
    w_BV = (logits_BV - logits_BV.max(dim=-1, keepdim=True).values).exp_()
    cdf_BV = torch.cumsum(w_BV, dim=-1, dtype=torch.float64)
    target_B1 = keyed_uniform(seeds_B, index)[:, None] * cdf_BV[:, -1:]
    return torch.searchsorted(cdf_BV, target_B1).squeeze(1)


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.24 renamed `past_key_values` to `cache`; use whichever this model's forward takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _anyone_running(done_B: torch.Tensor, synced: bool) -> bool:
    running = (~done_B).any()
    if synced and dist.is_available() and dist.is_initialized():
        flag = running.to(torch.float32).reshape(1)
        dist.all_reduce(flag)
        return bool(flag.item() > 0)
    return bool(running)


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Completion text without special tokens (the final EOS is dropped)."""
    rows = [ids[m.bool()] for ids, m in zip(rollout.completion_ids_BC, rollout.completion_mask_BC)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


@dataclass
class SamplingSettings:
    """Everything that shapes the sampled distribution; nothing else may leak in. Temperature 0 is
    greedy decoding in both engines."""

    max_new_tokens: int
    temperature: float
    top_p: float
    eos_token_ids: list[int]
    pad_token_id: int


def assemble(
    prompt_ids_BP,
    prompt_mask_BP,
    tokens: list[list[int]],
    logps: list[list[float]] | None,
    s: SamplingSettings,
) -> Rollout:
    """A `Rollout` from per-row completions (as an engine returns them): right-padded, masked after the
    first EOS exactly as `sampling.sample` masks."""
    width = max(1, max(len(t) for t in tokens))
    comp_BC = torch.full((len(tokens), width), s.pad_token_id, dtype=torch.long)
    logp_BC = torch.zeros((len(tokens), width), dtype=torch.float32)
    for i, t in enumerate(tokens):
        comp_BC[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        if logps is not None:
            logp_BC[i, : len(t)] = torch.tensor(logps[i], dtype=torch.float32)
    comp_BC, logp_BC = comp_BC.to(prompt_ids_BP.device), logp_BC.to(prompt_ids_BP.device)
    mask_BC = completion_mask(comp_BC, s.eos_token_ids)
    # Rows shorter than the widest end in padding, which must not be read as tokens.
    lengths_B = torch.tensor([len(t) for t in tokens], device=comp_BC.device)
    mask_BC = mask_BC * (torch.arange(width, device=comp_BC.device)[None] < lengths_B[:, None]).long()
    comp_BC = torch.where(mask_BC.bool(), comp_BC, s.pad_token_id)
    return Rollout(
        input_ids_BT=torch.cat([prompt_ids_BP, comp_BC], dim=1),
        attention_mask_BT=torch.cat([prompt_mask_BP, mask_BC], dim=1),
        completion_mask_BC=mask_BC,
        prompt_len=prompt_ids_BP.shape[1],
        logprobs_BC=logp_BC * mask_BC if logps is not None else None,
    )
