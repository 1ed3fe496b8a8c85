"""A teacher given as its top-K log-probabilities (`teacher_logprobs: topk:K`, `TopKTeacher`): an ordinary
vLLM generation server's `prompt_logprobs` (`PromptLogprobsClient`), no head and no hidden states here, so the
loss is the approximate top-K divergence (`divergence.chunked_topk_divergence`), on the student's vocabulary,
at temperature 1 (the served log-probabilities are at 1), labelled as approximate beside the loss in
metrics.jsonl. Each row is sent whole (a multi-turn transcript too: the prompt, the student's turns and the
tools' tokens between them), and the top-K are kept at the positions predicting the student's tokens
(`RolloutRecord.predicting_BT`, several runs per row in a transcript).

    client = PromptLogprobsClient("http://node7:8000")            # an ordinary `vllm serve` generation server
    ids_TK, logp_TK = client.topk([row_ids], k=20)[0]              # entry t: the top-K for token t+1
    teacher, check = job_topk_teacher(cfg, tokenizer)              # a job's, checked as a served teacher is
"""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING

import torch

from opdkit.opd.teachers.base import DivergenceInputs, Teacher, student_states
from opdkit.opd.teachers.served import (
    ServedCheck,
    ServedTeacherMismatch,
    ServerClient,
    TeacherServerError,
    check_server,
    job_client,
    longest,
    probe_text,
)
from opdkit.opd.teachers.topk.divergence import TEMPERATURE_REFUSAL, chunked_topk_divergence
from opdkit.rollout.source import RolloutRecord

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


def student_topk_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    t_ids_NK: torch.Tensor,
    t_logprobs_NK: torch.Tensor,
    **divergence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`local.student_divergence` against a teacher's top-K log-probabilities: the approximate divergence,
    from the student's own states and head."""
    s_hidden_NH, s_head_VH = student_states(student, fwd, pred_BT)
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out = chunked_topk_divergence(s_hidden_NH, s_head_VH, t_ids_NK, t_logprobs_NK, **divergence)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N


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


class TopKTeacher(Teacher, torch.nn.Module):
    """`teacher_logprobs: topk:K`: the teacher's top-K log-probabilities (ids and values) at the positions a
    trainer's `pred_BT` marks, from a `PromptLogprobsClient` (`model_name`: the served model). Approximate
    (see `divergence`); `chunked_topk_divergence` takes what `sparse` returns. `prepare_step` sends a step's
    rows in one request before its micro-batches, as `served.ServedTeacher` does. The module this process
    holds of it is itself, without parameters: the training process holds nothing of the teacher."""

    name = "top-K teacher"
    exact = False
    another_tokenizer_refusal = (
        "teacher_logprobs topk needs a teacher with the student's tokenizer (the served ids are the "
        "student's vocabulary); use teacher_logprobs exact for a teacher with another one."
    )

    def __init__(self, client: PromptLogprobsClient, k: int, model_name: str = ""):
        torch.nn.Module.__init__(self)
        if k < 1:
            raise ValueError(f"k={k}: the top-K needs K >= 1")
        self.client, self.k, self.model_name = client, k, model_name
        self._cache: dict[bytes, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self

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

    def start(self, student, tokenizer, args) -> None:
        if args.kl_temperature != 1.0:
            raise ValueError(TEMPERATURE_REFUSAL.format(temperature=args.kl_temperature))
        if args.process_index == 0:
            print(f"teacher_logprobs {self.label}: the loss is APPROXIMATE", flush=True)

    def prepare_batches(self, batches: list[dict], step: int) -> None:
        if batches:
            self.prepare_step(batches)

    def score(self, record: RolloutRecord, own, fwd: dict, pred_BT: torch.Tensor):
        """The teacher's top-K (ids, log-probabilities) at the predicting positions."""
        return self.sparse(fwd["input_ids"], fwd["attention_mask"], pred_BT)

    def student_divergence(self, student, fwd, pred_BT, part, given: DivergenceInputs):
        t_ids_NK, t_logp_NK = part
        return student_topk_divergence(student, fwd, pred_BT, t_ids_NK, t_logp_NK, **given.one_vocabulary())

    def metrics(self, sums) -> dict:
        return {"teacher_logprobs": f"topk:{self.k} (approximate)"}

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
    found = check_server(client, tokenizer, cfg.teacher_model, longest(cfg))  # a transcript at its longest
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
