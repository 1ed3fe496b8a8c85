"""The approximate divergence from a teacher's top-K log-probabilities (`teacher_logprobs: topk:K`), what
serving kits that send log-probabilities instead of states compute, and the client that gets them.

    client = PromptLogprobsClient("http://node7:8000")            # an ordinary `vllm serve` generation server
    ids_TK, logp_TK = client.topk([row_ids], k=20)[0]              # entry t: the top-K for token t+1
    div_N = topk_divergence(student_logits_NV, ids_NK, logp_NK, beta=1.0)     # approximate, labelled so

What it computes, precisely. At each position the server names a support S: the teacher's K most likely
tokens (vLLM adds the token that was actually there when it is not among them). Both distributions are
coarse-grained onto S plus one bin for everything else: the student's p(s) for s in S and its tail
p(rest) = sum of p over the other tokens (exact: from its full row of logits), the teacher's q(s) as served
and q(rest) = 1 - sum over S of q(s) (floored at `TAIL_FLOOR`). The divergence is the generalized JSD
(`loss.per_token_divergence`'s convention) between these two distributions on |S| + 1 bins.

How it is biased. Coarse-graining can only lose information: for every f-divergence (both KLs and the
generalized JSD are), the divergence of the coarse-grained pair is <= the exact one (data processing
inequality), with equality only when p/q is constant on the tail. So the top-K loss under-states the
divergence, most where the student puts mass on tokens the teacher ranks below K (on-policy, reverse KL:
exactly the mistakes it should be punished for), and its gradient moves only the tail's total mass, never
its shape. K = V (the whole vocabulary) is exact. The peers differ: TRL's server path uses top-1 plus such
a tail bin; verl (top-32) and NeMo-RL (top-64) renormalise over S and drop the tail, which is not a bound.

Pitfalls this module exists for:
- vLLM's `prompt_logprobs` are those of the raw logits (temperature 1, whatever the request's
  temperature); the teacher's tail mass at another temperature is the log-sum-exp of logits it never sent,
  so `topk` refuses `temperature != 1` instead of guessing;
- position t of `prompt_logprobs` is the distribution of token t given the tokens before it (position 0 has
  none); the trainer's convention is the state at t predicting token t+1: `topk` shifts by one;
- the served log-probabilities are float32, computed against a float32 log-sum-exp: their sum over S is
  known to ~1e-7, so the teacher's tail mass is too, and a teacher that gives the rest less than that
  (the tiny teacher gives some tokens 1e-8) has its tail floored at `TAIL_FLOOR`: one more under-statement,
  where the student puts mass the teacher rules out. Measured on the tiny world (reverse KL, 6 rows of
  greedy tiny-task text): 52 %, 29 %, 10 % and 0.12 % of the exact divergence missing at K = 1, 5, 20, 100
  of V = 101 (tests/test_opd_served_vllm.py).
"""

from __future__ import annotations

import json
import math
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from opdkit.opd.loss import DivergenceOutput
from opdkit.opd.served import (
    ServedCheck,
    ServedTeacherMismatch,
    ServerClient,
    TeacherServerError,
    check_server,
    job_client,
    probe_text,
)

# The smallest teacher tail mass: float32 log-probabilities (as served) fix their sum to ~1e-8.
TAIL_FLOOR = 1e-7


def teacher_topk(logits_NV: torch.Tensor, k: int, actual_N: torch.Tensor | None = None):
    """(ids (N, K or K+1), log-probabilities) of each row's K most likely tokens at temperature 1, as a
    server sends them; with `actual_N`, a (K+1)-th slot holds that token where it is not among them
    (id -1, log-prob -inf where it is)."""
    logp_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    logp_NK, ids_NK = logp_NV.topk(k, dim=-1)
    if actual_N is None:
        return ids_NK, logp_NK
    outside_N = ~(ids_NK == actual_N[:, None]).any(-1)
    extra_id_N = torch.where(outside_N, actual_N, -1)
    extra_logp_N = torch.where(outside_N, logp_NV.gather(1, actual_N[:, None]).squeeze(1), -math.inf)
    return torch.cat([ids_NK, extra_id_N[:, None]], 1), torch.cat([logp_NK, extra_logp_N[:, None]], 1)


def coarse_student(logp_NV: torch.Tensor, ids_NK: torch.Tensor) -> torch.Tensor:
    """(N, K+1): the student's log-probability of each support id (-inf in unused slots, id < 0) and, last,
    of everything else (exact, from the full row; -inf when the support is the whole row)."""
    valid_NK = ids_NK >= 0
    safe_NK = ids_NK.clamp(min=0)
    on_NK = torch.where(valid_NK, logp_NV.gather(1, safe_NK), -math.inf)
    # Counted, not written: an unused slot (id -1, read as 0) must not unmark token 0.
    in_S_NV = torch.zeros_like(logp_NV, dtype=torch.int32).scatter_add_(1, safe_NK, valid_NK.int()) > 0
    tail_N = torch.logsumexp(logp_NV.masked_fill(in_S_NV, -math.inf), dim=-1)
    return torch.cat([on_NK, tail_N[:, None]], 1)


def coarse_teacher(logp_NK: torch.Tensor, ids_NK: torch.Tensor, full_support_N: torch.Tensor) -> torch.Tensor:
    """(N, K+1): the served log-probabilities (-inf in unused slots) and, last, log(1 - their mass), floored
    at `TAIL_FLOOR` (-inf where the support is the whole row)."""
    on_NK = torch.where(ids_NK >= 0, logp_NK.double(), -math.inf)
    mass_N = on_NK.exp().sum(-1)
    tail_N = torch.log((1 - mass_N).clamp(min=TAIL_FLOOR))
    tail_N = torch.where(full_support_N, -math.inf, tail_N)
    return torch.cat([on_NK, tail_N[:, None]], 1)


def bins_divergence(logp_s_NB: torch.Tensor, logp_t_NB: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD (beta 0: KL(T||S), 1: KL(S||T)) between two distributions on B bins given as
    log-probabilities; a bin both give probability 0 contributes nothing."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta}")

    def kl(logp, logq):
        p = logp.exp()
        return torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)

    if beta == 0:
        return kl(logp_t_NB, logp_s_NB)
    if beta == 1:
        return kl(logp_s_NB, logp_t_NB)
    logp_m_NB = torch.logaddexp(logp_s_NB + math.log1p(-beta), logp_t_NB + math.log(beta))
    return beta * kl(logp_t_NB, logp_m_NB) + (1 - beta) * kl(logp_s_NB, logp_m_NB)


def topk_divergence(
    student_logits_NV: torch.Tensor,
    teacher_ids_NK: torch.Tensor,
    teacher_logprobs_NK: torch.Tensor,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-row divergence (N,) between the student's and the teacher's distributions coarse-grained onto the
    teacher's support plus a tail bin (see the module's docstring); differentiable in the student's logits.
    The teacher's log-probabilities are at temperature 1, so only `temperature == 1` is accepted."""
    return _topk_rows(student_logits_NV, teacher_ids_NK, teacher_logprobs_NK, beta, temperature)[0]


def _topk_rows(logits_NV, ids_NK, logp_t_NK, beta: float, temperature: float):
    """(divergence, student entropy) per row."""
    if temperature != 1.0:
        raise ValueError(TEMPERATURE_REFUSAL.format(temperature=temperature))
    logp_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    vocab = logp_NV.shape[1]
    if int(ids_NK.max()) >= vocab if ids_NK.numel() else False:
        raise ValueError(
            f"the teacher's support names token {int(ids_NK.max())} but the student has {vocab} logits; "
            "slice both to the tokenizer's vocabulary and drop ids beyond it."
        )
    full_N = (ids_NK >= 0).sum(-1) >= vocab
    logp_s_NB = coarse_student(logp_NV, ids_NK).double()
    logp_t_NB = coarse_teacher(logp_t_NK, ids_NK, full_N)
    div_N = bins_divergence(logp_s_NB, logp_t_NB, beta).to(logp_NV.dtype)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1).detach()
    return div_N, entropy_N


TEMPERATURE_REFUSAL = (
    "teacher_logprobs topk at kl_temperature={temperature}: the teacher's top-K log-probabilities are at "
    "temperature 1 and its tail mass at another temperature cannot be known from them; use kl_temperature 1, "
    "or teacher_logprobs exact (hidden states), which has every logit."
)


def chunked_topk_divergence(
    student_hidden_NH: torch.Tensor,
    student_head_weight_VH: torch.Tensor,
    teacher_ids_NK: torch.Tensor,
    teacher_logprobs_NK: torch.Tensor,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int = 1024,
    target_ids_N: torch.Tensor | None = None,
) -> DivergenceOutput:
    """`topk_divergence` from the student's final hidden states and head (sliced to `vocab_size`), a chunk
    of rows at a time; each chunk's logits are recomputed in the backward pass (activation checkpointing)
    instead of kept. Support ids beyond `vocab_size` are dropped (they fall into the tail bin). With
    `target_ids_N`, the student's log-probability of each row's target token over its whole head, as
    `chunked_divergence` gives it (the engine log-prob gap compares it)."""
    full_VH = student_head_weight_VH
    vocab = vocab_size or full_VH.shape[0]
    keep_NK = teacher_ids_NK < vocab
    ids_NK = torch.where(keep_NK, teacher_ids_NK, -1)
    logp_NK = torch.where(keep_NK, teacher_logprobs_NK, -math.inf)
    if target_ids_N is None:
        target_ids_N = torch.zeros(student_hidden_NH.shape[0], dtype=torch.long, device=ids_NK.device)
        want_target = False
    else:
        want_target = True

    def chunk(h_RH, ids_RK, logp_RK, target_R):
        logits_RV = F.linear(h_RH, full_VH.to(h_RH.dtype))
        div_R, ent_R = _topk_rows(logits_RV[:, :vocab], ids_RK, logp_RK, beta, temperature)
        token_R = torch.log_softmax(logits_RV.float(), -1).gather(1, target_R[:, None]).squeeze(1).detach()
        return div_R, ent_R, token_R

    rows = [slice(s, s + chunk_size) for s in range(0, student_hidden_NH.shape[0], chunk_size)]
    parts = [
        checkpoint(chunk, student_hidden_NH[r], ids_NK[r], logp_NK[r], target_ids_N[r], use_reentrant=False)
        for r in rows
    ]
    if not parts:
        zero = student_hidden_NH.sum() * 0.0
        empty = zero.new_zeros(0)
        return DivergenceOutput(zero, empty, empty, empty if want_target else None)
    div_N = torch.cat([d for d, _, _ in parts])
    return DivergenceOutput(
        sum=div_N.sum(),
        per_token_N=div_N.detach(),
        student_entropy_N=torch.cat([e for _, e, _ in parts]),
        student_token_logprob_N=torch.cat([t for _, _, t in parts]) if want_target else None,
    )


class PromptLogprobsClient(ServerClient):
    """An ordinary vLLM generation server's log-probabilities of given sequences: POST /v1/completions with
    the token ids as the prompt, `max_tokens` 1 and `prompt_logprobs` K (the server's --max-logprobs must
    allow K)."""

    def __init__(self, url: str, model: str | None = None, **kwargs):
        super().__init__(url, **kwargs)
        self._model = model

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self.models()[0]["id"]
        return self._model

    def topk(self, rows: list[list[int]], k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per row (ids (T-1, K+1), log-probabilities): entry t is the teacher's top-K for token t+1 (what the
        state at t predicts), plus the actual token t+1 in the last slot where it is outside them (else id
        -1, log-prob -inf), as `teacher_topk` lays them out."""
        payload = {
            "model": self.model,
            "prompt": rows,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": k,
        }
        t0 = time.perf_counter()
        body = self.call("POST", "/v1/completions", payload)
        t1 = time.perf_counter()
        with self.lock:
            self.stats.request_s += t1 - t0
        choices = sorted(json.loads(body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(rows):
            raise TeacherServerError(f"{self.url} answered {len(choices)} rows to a request of {len(rows)}.")
        out = [_topk_row(c["prompt_logprobs"], row, k, self.url) for c, row in zip(choices, rows)]
        with self.lock:
            s = self.stats
            s.requests += 1
            s.rows += len(rows)
            s.tokens += sum(len(r) for r in rows)
            s.bytes += len(body)
            s.decode_s += time.perf_counter() - t1
        return out


class TopKTeacher(torch.nn.Module):
    """`teacher_logprobs: topk:K`: the teacher's top-K log-probabilities (ids and values) at the positions a
    trainer's `pred_BT` marks, from a `PromptLogprobsClient`. Approximate (see the module's docstring);
    `chunked_topk_divergence` takes what `sparse` returns. `DistillTrainer` recognises it (no head, no
    hidden states) and computes the top-K divergence instead of the exact one; `prepare_step` sends a step's
    rows in one request before its micro-batches, as `served.ServedTeacher` does. A module without
    parameters: the training process holds nothing of the teacher."""

    approximate = True

    def __init__(self, client: PromptLogprobsClient, k: int, name: str = ""):
        super().__init__()
        if k < 1:
            raise ValueError(f"k={k}: the top-K needs K >= 1")
        self.client, self.k, self.name = client, k, name
        self._cache: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def label(self) -> str:
        """How a run names its divergence: approximate, and at which K."""
        return f"topk:{self.k} (approximate: the teacher's top-{self.k} log-probabilities plus a tail bin)"

    @property
    def stats(self):
        return self.client.stats

    def prepare_step(self, batches: list[dict]) -> None:
        """Every row of a step's micro-batches (`input_ids`, `attention_mask`) asked for in one request now;
        `sparse` then reads them from here."""
        rows = [r for b in batches for r in _unpadded_rows(b["input_ids"], b["attention_mask"])[0]]
        if rows:
            for row, got in zip(rows, self.client.topk(rows, self.k)):
                self._cache.setdefault(_row_key(row), []).append(got)

    def sparse(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, pred_BT: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (N, K+1), log-probabilities) for the N positions `pred_BT` marks, row after row (the order of
        `hidden[pred_BT]`); the last slot holds the actual next token where it is outside the top K."""
        rows, firsts = _unpadded_rows(input_ids_BT, attention_mask_BT)
        out: list = [None] * len(rows)
        for b, row in enumerate(rows):
            cached = self._cache.get(_row_key(row))
            if cached:
                out[b] = cached.pop(0)
                if not cached:
                    del self._cache[_row_key(row)]
        missing = [b for b, o in enumerate(out) if o is None]
        if missing:
            for b, got in zip(missing, self.client.topk([rows[b] for b in missing], self.k)):
                out[b] = got
        pred_BT = pred_BT.cpu()
        ids, logps = [], []
        for b, (first, (ids_TK, logp_TK)) in enumerate(zip(firsts, out)):
            at_T = pred_BT[b].nonzero().squeeze(1) - first  # a state at unpadded t predicts token t+1
            ids.append(ids_TK[at_T])
            logps.append(logp_TK[at_T])
        device = input_ids_BT.device
        return torch.cat(ids).to(device), torch.cat(logps).to(device)

    def close(self) -> None:
        self._cache.clear()


def job_topk_teacher(cfg, tokenizer) -> tuple[TopKTeacher, ServedCheck]:
    """A job's `teacher_logprobs: topk:K` teacher: the generation server at `teacher_server` checked as a
    served teacher is (`served.check_server`: one model, its name, context, tokenizer), then asked for a
    probe's top-K (refused: its --max-logprobs is below K, or its vocabulary is smaller than the
    tokenizer's). Returns the teacher and what was found, the probe's log-probabilities as its fingerprint."""
    k = cfg.topk()
    pooling = job_client(cfg)  # the URL checked, the timeouts and retries of a served teacher
    client = PromptLogprobsClient(pooling.url, timeout_s=pooling.timeout_s, retries=pooling.retries)
    found = check_server(
        client, tokenizer, cfg.teacher_model, cfg.max_prompt_length + cfg.rollout_max_new_tokens
    )
    probe = tokenizer(probe_text(tokenizer), add_special_tokens=False)["input_ids"] + [len(tokenizer) - 1]
    try:
        ((ids_TK, logp_TK),) = client.topk([probe], k)
    except (TeacherServerError, KeyError) as e:
        raise ServedTeacherMismatch(
            f"{client.url} refused a probe with prompt_logprobs {k} (teacher_logprobs topk:{k}): it must be "
            f"a generation server (not --runner pooling) started with --max-logprobs {k} or more, for a "
            f"model taking the tokenizer's {len(tokenizer)} ids ({e})"
        ) from None
    actual_T = torch.tensor(probe[1:])[:, None]
    probe_logprobs = logp_TK.masked_fill(ids_TK != actual_T, 0.0).sum(1).tolist()  # the actual token's
    check = ServedCheck(
        url=client.url,
        served_name=found.name,
        served_root=found.root,
        max_model_len=found.max_model_len,
        hidden_size=0,
        head_rows=0,
        head_source=f"none (teacher_logprobs topk:{k})",
        tokenizer_checked=found.tokenizer_checked,
        state_gap=float("nan"),
        probe_ids=list(probe),
        probe_logprobs=probe_logprobs,
    )
    return TopKTeacher(client, k, cfg.teacher_model), check


def _unpadded_rows(input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor):
    """Each row's real tokens (from its first to its last attended one) and where they start."""
    ids_BT, attn_BT = input_ids_BT.cpu(), attention_mask_BT.cpu().bool()
    rows, firsts = [], []
    for b in range(ids_BT.shape[0]):
        where = attn_BT[b].nonzero().squeeze(1)
        first = int(where[0]) if where.numel() else 0
        rows.append(ids_BT[b, first : first + where.numel()].tolist())
        firsts.append(first)
    return rows, firsts


def _row_key(row: list[int]) -> bytes:
    return torch.tensor(row, dtype=torch.int64).numpy().tobytes()


def _topk_row(entries: list, row: list[int], k: int, url: str) -> tuple[torch.Tensor, torch.Tensor]:
    if entries is None or len(entries) != len(row):
        raise TeacherServerError(f"{url} sent no prompt_logprobs for a row of {len(row)} tokens.")
    ids_TK = torch.full((len(row) - 1, k + 1), -1, dtype=torch.long)
    logp_TK = torch.full((len(row) - 1, k + 1), -math.inf)
    for t, entry in enumerate(entries[1:]):
        ranked = sorted(((int(i), v) for i, v in entry.items()), key=lambda x: x[1]["rank"])
        top = [(i, v["logprob"]) for i, v in ranked if v["rank"] <= k][:k]
        for j, (i, lp) in enumerate(top):
            ids_TK[t, j], logp_TK[t, j] = i, lp
        actual = row[t + 1]
        if actual not in {i for i, _ in top}:
            ids_TK[t, k], logp_TK[t, k] = actual, entry[str(actual)]["logprob"]
    return ids_TK, logp_TK
