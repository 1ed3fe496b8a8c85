"""`ServedTeacher`: a frozen teacher whose final hidden states come from a pooling server
(`client.PoolingClient`) and whose output head is read alone from the checkpoint (`head.load_head`), so the
divergence is the in-process teacher's (`local.LocalTeacher`, the kind it extends). What differs: the step's
rows are sent before its micro-batches (`prepare_batches`), nothing is sharded (only the head is here), and
with a reference (the same teacher in this process, `reference`) the served states x head are compared with
it on the first `CHECK_STEPS` steps (`teacher_logprob_gap`): past the server dtype's tolerance the run stops
before the step's update (`ServedTeacherMismatch`, one line). The start checks cannot see a wrong head; this
can.

Pitfalls this module exists for:
- the server must return the *final, post-norm* states as they are: vLLM's pooling runner does so only with
  `run.server.HIDDEN_STATES_POOLER` (`use_activation: false`, else each state is L2-normalised); the first
  requests' states are checked against the checkpoint's final norm (`checks.state_gap`);
- rows reach the server without padding: a row's positions are 0..n-1 as in the trainer's forward
  (left-padded prompts take their positions from the attention mask), so its real tokens must be one
  contiguous run; the states go back to the padded places;
- a whole step at full size is gigabytes of states (64 rows x 8k tokens x 2,560 x 4 B = 5.4 GB): requests
  carry at most `max_request_tokens` tokens, a few in flight at once, and only the states the divergence
  reads (where `pred_BT` marks) are kept after `prepare_step`;
- a multi-turn transcript (the prompt, the student's turns, the template's and the tools' tokens between
  them) is one row: it is sent whole, so each state has the whole context before it, and only the states
  that predict one of the student's tokens are kept; the tools' and the template's are dropped.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from transformers.modeling_outputs import BaseModelOutput

from opdkit.opd.teachers.local import LocalTeacher, States
from opdkit.opd.teachers.served.checks import (
    FINGERPRINT_TOLERANCE,
    STATE_TOLERANCE,
    ServedCheck,
    ServedTeacherMismatch,
    check_server,
    probe_logprobs,
    probe_text,
    state_gap,
)
from opdkit.opd.teachers.served.client import PoolingClient, TeacherServerError, TransferStats
from opdkit.opd.teachers.served.head import TeacherHead
from opdkit.rollout.source import RolloutRecord

# Rows per request: vLLM describes each row of a bytes answer in one header line (~110 B a row), which a
# client reads up to a limit (Python's http.client 64 KiB, httpx's 100 KiB): 256 rows stay below both.
MAX_REQUEST_ROWS = 256
CHECK_STEPS = 2  # steps whose first micro-batch is compared with the reference (`teacher_logprob_gap`)


class _ServedBackbone(torch.nn.Module):
    """The teacher's `base_model`: the served states in the padded (B, T, H) layout."""

    def __init__(self, states):
        super().__init__()
        self._states = states

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> BaseModelOutput:
        return BaseModelOutput(last_hidden_state=self._states(input_ids, attention_mask, position_ids))


@dataclass
class _Cached:
    at_N: torch.Tensor | None  # the positions of the row (unpadded) whose states are kept; None: every one
    states_NH: torch.Tensor


class ServedTeacher(LocalTeacher, torch.nn.Module):
    """A frozen teacher whose final hidden states come from a pooling server and whose head is `head` (read
    alone from the checkpoint); the module this process holds of it is itself (its head, and the reference
    if any), which presents `base_model` and `get_output_embeddings` as a model does, so a teacher set or the
    ADS teacher takes it as one. `check_calls`: how many requests have every state checked against the
    checkpoint's final norm (`state_gap`, tolerance `STATE_TOLERANCE[served_dtype]`); `max_request_tokens` /
    `in_flight`: how a step's rows are cut into requests and how many go at once; `reference`: the same
    teacher in process, for `teacher_logprob_gap` on the first `CHECK_STEPS` steps (the state check cannot
    see a wrong head; this can)."""

    name = "served teacher"

    def __init__(
        self,
        client: PoolingClient,
        head: TeacherHead,
        served_dtype: str = "bfloat16",
        check_calls: int = 2,
        max_request_tokens: int = 32768,
        in_flight: int = 2,
        reference: torch.nn.Module | None = None,
    ):
        torch.nn.Module.__init__(self)
        # The teacher in this process as well, where one fits: the served states x head are compared with it
        # on the first steps (`teacher_logprob_gap`) and a wrong run stopped.
        self.reference = reference.eval().requires_grad_(False) if reference is not None else None
        self.client, self.model_name, self.head_source = client, head.name, head.source
        self.config = head.config
        self.served_dtype = served_dtype
        # The coarser of the server's dtype and the one the states travel in decides the rounding.
        self.tolerance = max(
            STATE_TOLERANCE.get(d, STATE_TOLERANCE["bfloat16"]) for d in (served_dtype, client.dtype)
        )
        lm_head = torch.nn.Linear(head.hidden_size, head.rows, bias=False, device="meta")
        lm_head.weight = torch.nn.Parameter(head.weight_VH, requires_grad=False)
        self.lm_head = lm_head
        self.register_buffer("norm_weight_H", head.norm_weight_H, persistent=False)
        self.backbone = _ServedBackbone(self.states)
        self.checks_left, self.state_gaps = check_calls, []
        self.max_request_tokens, self.in_flight = max_request_tokens, in_flight
        self._pool = ThreadPoolExecutor(max_workers=max(1, in_flight), thread_name_prefix="served-teacher")
        self._pending: list[Future] = []
        self._cache: dict[bytes, list[_Cached]] = {}
        self.sharded = False
        self._gap_checks_left, self._check_now, self._step = 0, False, 0
        self.vocab_size = 0  # the tokenizer its rows are in (`start`)
        self.eval().requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self

    @property
    def base_model(self) -> torch.nn.Module:
        return self.backbone

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @property
    def stats(self) -> TransferStats:
        return self.client.stats

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        """Logits (B, T, V) of the served states and the head: for diagnostics; training uses the states."""
        h_BTH = self.states(input_ids, attention_mask, position_ids)
        return self.lm_head(h_BTH.to(self.lm_head.weight.dtype))

    def prepare_step(self, batches: list[dict]) -> None:
        """Send every row of a step's micro-batches (`input_ids`, `attention_mask`, and `pred_BT`: the
        positions whose states the divergence reads) now, each row whole (a multi-turn transcript with its
        tools' tokens), in requests of at most `max_request_tokens` tokens, `in_flight` at a time; `states`
        then waits for them. Only the states at the positions `pred_BT` marks are kept (a teacher with
        another tokenizer sends its own tokens and marks, `cross.Retokenizer.prepare`)."""
        self._wait()
        rows, kept = [], []
        for b in batches:
            rows += _unpadded(b["input_ids"], b["attention_mask"], None)[0]
            kept += _marked(b["pred_BT"], b["attention_mask"])
        for part in _requests(rows, self.max_request_tokens):
            chunk, keep = [rows[i] for i in part], [kept[i] for i in part]
            self._pending.append(self._pool.submit(self._fetch_into_cache, chunk, keep))

    def _fetch_into_cache(self, rows: list[list[int]], kept: list[torch.Tensor]) -> None:
        states = self._fetch(rows)
        for ids, at_N, states_TH in zip(rows, kept, states):
            self._cache.setdefault(_key(ids), []).append(_Cached(at_N, states_TH[at_N]))

    def _fetch(self, rows: list[list[int]]) -> list[torch.Tensor]:
        """One request's states, checked against the final norm while `check_calls` lasts."""
        states = self.client.hidden_states(rows)
        with self.client.lock:
            check, self.checks_left = self.checks_left > 0, self.checks_left - 1
        if check and self.norm_weight_H is not None:
            self._check_states(torch.cat(states) if states else torch.zeros(0, self.lm_head.in_features))
        return states

    def _wait(self, keys: list[bytes] | None = None) -> None:
        """Wait for the prepared requests, in the order they were sent, until every row of `keys` has
        arrived (all of them without `keys`): the first micro-batch needs only the first requests."""
        while self._pending and (keys is None or any(k not in self._cache for k in keys)):
            self._pending.pop(0).result()  # a server error is raised here, in the trainer's thread

    def states(self, input_ids_BT, attention_mask_BT=None, position_ids_BT=None) -> torch.Tensor:
        """The served final hidden states (B, T, H) in the head's dtype on `input_ids_BT`'s device, zero at
        padding (and, for rows sent by `prepare_step`, wherever its `pred_BT` marked nothing)."""
        if attention_mask_BT is None:
            attention_mask_BT = torch.ones_like(input_ids_BT)
        rows, firsts = _unpadded(input_ids_BT, attention_mask_BT, position_ids_BT)
        self._wait([_key(r) for r in rows])
        found = [self._take(r) for r in rows]
        missing = [i for i, c in enumerate(found) if c is None]
        for part in _requests([rows[i] for i in missing], self.max_request_tokens):
            chunk = [rows[missing[i]] for i in part]
            for i, states_TH in zip(part, self._fetch(chunk)):
                found[missing[i]] = _Cached(None, states_TH)
        B, T = input_ids_BT.shape
        h_BTH = torch.zeros(B, T, self.lm_head.in_features, dtype=self.lm_head.weight.dtype)
        for b, (first, c) in enumerate(zip(firsts, found)):
            if c.at_N is None:
                h_BTH[b, first : first + c.states_NH.shape[0]] = c.states_NH.to(h_BTH.dtype)
            else:
                h_BTH[b, first + c.at_N] = c.states_NH.to(h_BTH.dtype)
        return h_BTH.to(input_ids_BT.device, non_blocking=True)

    def _take(self, ids: list[int]) -> _Cached | None:
        found = self._cache.get(_key(ids))
        if not found:
            return None
        c = found.pop()
        if not found:
            del self._cache[_key(ids)]
        return c

    def _check_states(self, states_NH: torch.Tensor) -> None:
        gap = state_gap(states_NH, self.norm_weight_H)
        self.state_gaps.append(gap)
        if not gap <= self.tolerance:  # NaN too
            self.checks_left = 0
            raise ServedTeacherMismatch(
                f"the states served by {self.client.url} are not the output of {self.model_name}'s final "
                f"norm (rms(h / g) off 1 by {gap:.3g}, tolerance {self.tolerance:g} for a "
                f"{self.served_dtype} server): it serves another model, or pre-norm or normalised states; "
                "serve the teacher whose head this run holds, with --runner pooling --pooler-config "
                '\'{"task":"token_embed","tok_pooling_type":"ALL","use_activation":false}\'.'
            )

    def check(
        self,
        tokenizer=None,
        probe_ids: list[int] | None = None,
        expect_name: str | None = None,
        min_model_len: int = 0,
    ) -> ServedCheck:
        """Checks before training (each failure a `ServedTeacherMismatch` saying what to change): the
        server answers; it serves one model, named like `expect_name` (its last path part) if given; its
        context holds `min_model_len` tokens; its states have the head's width and are this checkpoint's
        final-norm output (`state_gap`, on a probe); its tokenizer (POST /tokenize, where the server has
        one) splits the probe text as `tokenizer` does. Returns what it found, with the probe's
        log-probabilities as the run's `fingerprint`."""
        found = check_server(self.client, tokenizer, expect_name, min_model_len)
        if probe_ids is None:
            if tokenizer is None:
                raise ValueError("check needs tokenizer= (to make and compare the probe) or probe_ids=")
            # The student's last token id too: a served model with a smaller vocabulary refuses it.
            probe_ids = tokenizer(probe_text(tokenizer), add_special_tokens=False)["input_ids"]
            probe_ids += [len(tokenizer) - 1]
        try:
            (states_TH,) = self.client.hidden_states([list(probe_ids)])
        except TeacherServerError as e:
            raise ServedTeacherMismatch(
                f"{self.client.url} refused the probe {list(probe_ids)} (the last id is the tokenizer's "
                f"largest, {max(probe_ids)}): its model does not take this vocabulary ({e})"
            ) from None
        if states_TH.shape[1] != self.lm_head.in_features:
            raise ServedTeacherMismatch(
                f"{self.client.url} serves states of width {states_TH.shape[1]} but the head of "
                f"{self.model_name} takes {self.lm_head.in_features}: another model is served."
            )
        gap = float("nan")
        if self.norm_weight_H is not None:
            self._check_states(states_TH)
            gap = self.state_gaps.pop()
        return ServedCheck(
            url=self.client.url,
            served_name=found.name,
            served_root=found.root,
            max_model_len=found.max_model_len,
            hidden_size=states_TH.shape[1],
            head_rows=self.lm_head.out_features,
            head_source=self.head_source,
            tokenizer_checked=found.tokenizer_checked,
            state_gap=gap,
            probe_ids=list(probe_ids),
            probe_logprobs=probe_logprobs(states_TH, self.lm_head.weight, list(probe_ids)),
        )

    def start(self, student, tokenizer, args) -> None:
        super().start(student, tokenizer, args)
        self.vocab_size, self.chunk_size = len(tokenizer), args.loss_chunk_size
        self.world_size = args.world_size
        self._gap_checks_left = CHECK_STEPS if self.reference is not None else 0  # each run's first steps

    def place(self, device, shard: bool) -> None:
        self.to(device)

    def prepare_batches(self, batches: list[dict], step: int) -> None:
        self._check_now, self._step = self._gap_checks_left > 0, step
        self._gap_checks_left -= self._check_now
        if batches:
            self.prepare_step(batches)

    def score(self, record: RolloutRecord, own, fwd: dict, pred_BT: torch.Tensor) -> States:
        part = super().score(record, own, fwd, pred_BT)
        if self._check_now:  # the step's first micro-batch
            self._check_now = False
            part.sums = self._check_reference(part, fwd, pred_BT)
        return part

    @torch.no_grad()
    def _check_reference(self, part: States, fwd: dict, pred_BT: torch.Tensor) -> torch.Tensor:
        """`teacher_logprob_gap`: the mean |log p_served - log p_reference| of the tokens the teacher reads
        (the student's, or with another tokenizer its own), the served states x this run's head against the
        reference, over the micro-batch summed across processes; past `FINGERPRINT_TOLERANCE` of the
        server's dtype the run stops before the step's update. Returns (gap sum, tokens), to log."""
        ref = self.reference
        target_N = fwd["input_ids"][:, 1:][pred_BT[:, :-1]]
        r_hidden_NH = ref.base_model(**fwd).last_hidden_state[pred_BT]
        r_head_VH = ref.get_output_embeddings().weight
        V, chunk = self.vocab_size, self.chunk_size
        gaps = []
        for s in range(0, target_N.shape[0], chunk):
            rows, tgt = slice(s, s + chunk), target_N[s : s + chunk, None]
            lp = [
                torch.log_softmax(h[rows].float() @ w[:V].float().T, -1).gather(1, tgt).squeeze(1)
                for h, w in ((part.hidden_NH, part.head_VH), (r_hidden_NH, r_head_VH))
            ]
            gaps.append((lp[0] - lp[1]).abs())
        gap_N = torch.cat(gaps) if gaps else part.hidden_NH.new_zeros(0)
        sums = torch.stack([gap_N.sum().double(), torch.tensor(float(gap_N.shape[0]), device=gap_N.device)])
        total = sums.clone()
        if self.world_size > 1 and dist.is_initialized():
            dist.all_reduce(total)
        gap = float(total[0] / total[1].clamp(min=1))
        dtype = self.served_dtype
        tolerance = FINGERPRINT_TOLERANCE.get(dtype, 0.1)
        if not gap <= tolerance:
            raise ServedTeacherMismatch(
                f"teacher_logprob_gap {gap:.3g} at step {self._step + 1} (tolerance "
                f"{tolerance:g} for a {dtype} server): the served states times this run's teacher head "
                "give other log-probabilities of the sampled tokens than the teacher in this process; the "
                "server serves another model than teacher_model, or the head is not its own. Stopped before "
                "the update."
            )
        return sums

    def new_sums(self, device) -> torch.Tensor | None:
        return None if self.reference is None else torch.zeros(2, dtype=torch.float64, device=device)

    def metrics(self, sums: list[float] | None) -> dict:
        if self.reference is None:
            return {}
        gap, tokens = sums
        return {"teacher_logprob_gap": gap / tokens if tokens else None}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._cache.clear()


def _key(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int64).tobytes()


def _unpadded(ids_BT, attn_BT, pos_BT) -> tuple[list[list[int]], list[int]]:
    """Each row's real tokens (one contiguous run, at positions 0..n-1) and where that run starts."""
    ids_BT, attn_BT = ids_BT.detach().cpu(), attn_BT.detach().cpu().bool()
    rows, firsts = [], []
    for b in range(ids_BT.shape[0]):
        where = attn_BT[b].nonzero().squeeze(1)
        n = where.numel()
        first = int(where[0]) if n else 0
        contiguous = n == 0 or int(where[-1]) - first + 1 == n
        if contiguous and pos_BT is not None and n:
            contiguous = bool((pos_BT[b, first : first + n].cpu() == torch.arange(n)).all())
        if not contiguous:
            raise ValueError(
                f"row {b}'s tokens are not one run at positions 0..n-1 (padding inside the row, or shifted "
                "positions); a served teacher sees each row unpadded, so pad prompts on the left and "
                "completions on the right."
            )
        rows.append(ids_BT[b, first : first + n].tolist())
        firsts.append(first)
    return rows, firsts


def _marked(pred_BT: torch.Tensor, attn_BT: torch.Tensor) -> list[torch.Tensor]:
    """Each row's positions that `pred_BT` marks, counted from the row's first real token: what
    `prepare_step` keeps of a padded row's states (a multi-turn row's marks come in several runs)."""
    pred, attn = pred_BT.detach().cpu().bool(), attn_BT.detach().cpu().bool()
    out = []
    for b in range(pred.shape[0]):
        real = attn[b].nonzero().squeeze(1)
        first = int(real[0]) if real.numel() else 0
        out.append(pred[b].nonzero().squeeze(1) - first)
    return out


def _requests(rows: list[list[int]], max_tokens: int, max_rows: int = MAX_REQUEST_ROWS) -> list[list[int]]:
    """Row indices cut into consecutive groups of at most `max_tokens` tokens and `max_rows` rows (a longer
    row alone)."""
    groups, current, size = [], [], 0
    for i, r in enumerate(rows):
        if current and (size + len(r) > max_tokens or len(current) == max_rows):
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += len(r)
    return groups + [current] if current else groups
