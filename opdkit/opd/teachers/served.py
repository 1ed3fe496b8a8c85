"""A teacher served elsewhere, exactly (`served.ServedTeacher`): its final hidden states from a vLLM pooling
server, its head here, so the divergence is the in-process teacher's (`local.LocalTeacher`). What differs: the
step's rows are sent before its micro-batches (`prepare_rows`), nothing is sharded (only the head is here),
and
with a reference (the same teacher in this process, `ServedTeacher.reference`) the served states x head are
compared with it on the first `CHECK_STEPS` steps (`teacher_logprob_gap`): past the server dtype's tolerance
the run stops before the step's update (`served.ServedTeacherMismatch`, one line). The start checks
cannot see a wrong head; this can.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from opdkit.opd import served
from opdkit.opd.teachers.local import LocalTeacher, States
from opdkit.rollout.source import RolloutRecord

CHECK_STEPS = 2


class ServedExact(LocalTeacher):
    """A `served.ServedTeacher` module as a teacher kind."""

    name = "served teacher"

    def __init__(self, module: served.ServedTeacher):
        super().__init__(module)
        self.reference = module.reference
        self._checks_left = CHECK_STEPS if self.reference is not None else 0
        self._check_now, self._step = False, 0
        self.vocab_size = 0  # the tokenizer its rows are in (`start`)

    def start(self, student, tokenizer, args) -> None:
        super().start(student, tokenizer, args)
        self.vocab_size, self.chunk_size = len(tokenizer), args.loss_chunk_size
        self.world_size = args.world_size

    def place(self, device, shard: bool) -> None:
        self.module.to(device)

    def prepare_rows(self, rows: list[dict], step: int) -> None:
        self._check_now, self._step = self._checks_left > 0, step
        self._checks_left -= self._check_now
        if rows:
            self.module.prepare_step(rows)

    def score(self, record: RolloutRecord, rows, fwd: dict, pred_BT: torch.Tensor) -> States:
        part = super().score(record, rows, fwd, pred_BT)
        if self._check_now:  # the step's first micro-batch
            self._check_now = False
            part.sums = self._check(part, fwd, pred_BT)
        return part

    @torch.no_grad()
    def _check(self, part: States, fwd: dict, pred_BT: torch.Tensor) -> torch.Tensor:
        """`teacher_logprob_gap`: the mean |log p_served - log p_reference| of the tokens the teacher reads
        (the student's, or with another tokenizer its own), the served states x this run's head against the
        reference, over the micro-batch summed across processes; past `served.FINGERPRINT_TOLERANCE` of the
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
        dtype = self.module.served_dtype
        tolerance = served.FINGERPRINT_TOLERANCE.get(dtype, 0.1)
        if not gap <= tolerance:
            raise served.ServedTeacherMismatch(
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
