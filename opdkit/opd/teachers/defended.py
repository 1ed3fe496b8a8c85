"""A defended teacher (`teacher_defence`): what a teacher's API returns in place of its log-probabilities,
transformed before the student's loss sees it, and what the student (an on-policy attacker) does with it.

    defence = Defence.of("topk:5")                        # none, topk:K, sampled, round:D, noise:S
    served = defence.serve(logits_NV, actual_N, gen)       # what the API sends for N scored positions
    teacher = DefendedTeacher(model, "round:1", seed=42)   # the kind the trainer is handed
    cost = honest_cost(defence, logits_NV, actual_N, gen)  # what an honest user of the scores loses

A defence maps the teacher's full next-token distribution at each scored position (its logits over the
tokenizer's vocabulary, temperature 1) to what is sent; `actual_N` is the token the student wrote there,
the one a scoring request asks about. The transforms are pure functions, so that a served teacher can apply
them server-side; here the in-process teacher's logits are transformed exactly as a server would before
sending. What is sent, and the attacker's loss on it:

    none      every log-probability: the exact divergence (`loss.chunked_divergence`, the plain teacher)
    topk:K    the K most likely tokens' log-probabilities and the scored token's where it is outside them (as
              vLLM's prompt_logprobs and every log-prob API send the chosen token): the kit's top-K
              divergence, the rest of the vocabulary one bin (`topk.divergence`)
    sampled   the scored token's log-probability alone: the per-token log-ratio loss of tinker's and slime's
              OPD, loss_t = sg(log s(y_t) - log t(y_t)) * log s(y_t) (`sampled_token_loss`), whose gradient
              is the sampled-token estimate of reverse KL's (E_s[(log s - log t) grad log s]); the loss
              logged is the log-ratio itself, with that gradient
    round:D   every log-probability rounded to D decimals; the attacker renormalises them (log_softmax, as a
              client must: they no longer sum to 1) and takes the exact divergence to that distribution
              (`loss.per_token_divergence`, a chunk of rows at a time)
    noise:S   every log-probability plus Gaussian noise of scale S nats, renormalised the same way

Pitfalls this module exists for:
- the scores are at temperature 1 (a server's log-probabilities are): a defended teacher refuses another
  kl_temperature, as the top-K teacher does;
- the scored token is the one after each predicting position (the state at t predicts token t+1), read
  from the record's rows in the order of `hidden[pred_BT]`;
- the noise is drawn afresh for every scored row, from a generator seeded once (`seed`): an attacker who
  could ask for the same row twice would average it away; a server would have to key it by the request;
- round and noise send the whole vocabulary per position (N x V floats): cheap at the tiny world's 101
  tokens, as heavy as full logits at a real one's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from opdkit.opd.loss import DivergenceOutput, per_token_divergence
from opdkit.opd.teachers.base import DivergenceInputs, Teacher, student_states
from opdkit.opd.teachers.local import LocalTeacher
from opdkit.opd.teachers.topk import TAIL_FLOOR, student_topk_divergence, teacher_topk
from opdkit.rollout.source import RolloutRecord
from opdkit.settings import parse_defence

TEMPERATURE_REFUSAL = (
    "teacher_defence {spec} at kl_temperature={temperature}: the defended teacher serves log-probabilities "
    "at temperature 1; set kl_temperature 1, or teacher_defence none."
)


def sampled_scores(logits_NV: torch.Tensor, actual_N: torch.Tensor) -> torch.Tensor:
    """(N,): the teacher's log-probability of each scored token, at temperature 1."""
    return torch.log_softmax(logits_NV.float(), -1).gather(1, actual_N[:, None]).squeeze(1)


def rounded_scores(logits_NV: torch.Tensor, decimals: int) -> torch.Tensor:
    """(N, V): every log-probability rounded to `decimals` decimals, as sent (not renormalised)."""
    return torch.round(torch.log_softmax(logits_NV.float(), -1), decimals=decimals)


def noised_scores(logits_NV: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """(N, V): every log-probability plus N(0, scale²) noise drawn from `generator`, as sent."""
    logp_NV = torch.log_softmax(logits_NV.float(), -1)
    noise_NV = torch.randn(logp_NV.shape, generator=generator, device=logp_NV.device)
    return logp_NV + scale * noise_NV


def sampled_token_loss(student_logp_N: torch.Tensor, teacher_logp_N: torch.Tensor) -> torch.Tensor:
    """(N,): sg(log s(y) - log t(y)) * log s(y) per scored token y, whose gradient is the sampled-token
    estimate of reverse KL's gradient (for y drawn from the student)."""
    return (student_logp_N - teacher_logp_N).detach() * student_logp_N


@dataclass(frozen=True)
class Defence:
    """One `teacher_defence`: its kind (`settings.DEFENCES`) and its number (K, D decimals, S nats; None
    for none and sampled)."""

    kind: str
    value: float | None = None

    @classmethod
    def of(cls, spec: str) -> Defence:
        return cls(*parse_defence(spec))

    @property
    def spec(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value:g}"

    def serve(self, logits_NV: torch.Tensor, actual_N: torch.Tensor, generator=None):
        """What the API sends for N scored positions: none, round and noise (N, V) log-probabilities, topk
        (ids (N, K+1), log-probabilities) as `topk.teacher_topk` lays them out, sampled (N,)."""
        if self.kind == "topk":
            return teacher_topk(logits_NV, int(self.value), actual_N)
        if self.kind == "sampled":
            return sampled_scores(logits_NV, actual_N)
        if self.kind == "round":
            return rounded_scores(logits_NV, int(self.value))
        if self.kind == "noise":
            return noised_scores(logits_NV, self.value, generator)
        return torch.log_softmax(logits_NV.float(), -1)

    def client_distribution(self, logits_NV: torch.Tensor, actual_N: torch.Tensor, generator=None):
        """(N, V) log-probabilities a client reads from what is sent: renormalised where it sends the whole
        vocabulary; for topk its tokens as sent and the rest's mass spread evenly over the tokens it does
        not name (its least committal reading); None for sampled (one token: no distribution)."""
        if self.kind == "sampled":
            return None
        served = self.serve(logits_NV, actual_N, generator)
        if self.kind != "topk":
            return torch.log_softmax(served, -1)
        return completed_topk(*served, logits_NV.shape[1])


def completed_topk(ids_NK: torch.Tensor, logp_NK: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, V): the served top-K log-probabilities in place (unused slots, id < 0, skipped), the rest of each
    row's mass (1 - their sum, at least `TAIL_FLOOR`) spread evenly over the tokens they do not name."""
    valid_NK = ids_NK >= 0
    mass_N = torch.where(valid_NK, logp_NK.double().exp(), 0.0).sum(-1)
    named_N = valid_NK.sum(-1)
    # floored as the top-K divergence floors the tail (`TAIL_FLOOR`): float32 log-probabilities fix their
    # sum to ~1e-7 only, and a client must not read a tail of zero (or below) from them
    rest_N = torch.log((1 - mass_N).clamp(min=TAIL_FLOOR)) - torch.log(
        (vocab - named_N).clamp(min=1).double()
    )
    out_NV = rest_N[:, None].expand(-1, vocab).clone()
    rows_NK = torch.arange(ids_NK.shape[0], device=ids_NK.device)[:, None].expand_as(ids_NK)
    out_NV[rows_NK[valid_NK], ids_NK[valid_NK]] = logp_NK[valid_NK].double()
    return out_NV.float()


def distribution_cost(logits_NV: torch.Tensor, served_logp_NV: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per position: `kl_N`, KL(teacher || served) in nats (the teacher at temperature 1), and `top1_N`, 1
    where the served distribution's most likely token is the teacher's and no other token ties with it."""
    logp_NV = torch.log_softmax(logits_NV.float(), -1)
    p_NV = logp_NV.exp()
    kl_N = torch.where(p_NV > 0, p_NV * (logp_NV - served_logp_NV), 0.0).sum(-1)
    top_N = logp_NV.argmax(-1)
    at_top_N = served_logp_NV.gather(1, top_N[:, None])
    others_NV = served_logp_NV.scatter(1, top_N[:, None], -math.inf)
    top1_N = (at_top_N.squeeze(1) > others_NV.amax(-1)).float()
    return {"kl_N": kl_N, "top1_N": top1_N}


def honest_cost(
    defence: Defence, logits_NV: torch.Tensor, actual_N: torch.Tensor, generator=None
) -> dict[str, torch.Tensor] | None:
    """What an honest user of the scores loses at N positions (`distribution_cost` of what a client reads
    from them); None for sampled, which sends no distribution to compare."""
    served = defence.client_distribution(logits_NV, actual_N, generator)
    return None if served is None else distribution_cost(logits_NV, served)


def chunked_student_rows(
    student_hidden_NH: torch.Tensor,
    student_head_VH: torch.Tensor,
    rows,
    served: tuple[torch.Tensor, ...],
    *,
    vocab_size: int,
    chunk_size: int = 1024,
    target_ids_N: torch.Tensor | None = None,
) -> DivergenceOutput:
    """The student's loss against served scores, a chunk of rows at a time, each chunk's logits recomputed in
    the backward pass (as `topk.chunked_topk_divergence`): `rows(logp_RV, *served_R)` gives (loss, what is
    logged as the per-token divergence) from the student's log-probabilities over `vocab_size` tokens and
    each of `served`'s rows. With `target_ids_N`, the student's log-probability of each target over its whole
    head, as `chunked_divergence` gives it."""
    want_target = target_ids_N is not None
    if not want_target:
        target_ids_N = torch.zeros(
            student_hidden_NH.shape[0], dtype=torch.long, device=student_hidden_NH.device
        )

    def chunk(h_RH, target_R, *served_R):
        logits_RV = F.linear(h_RH, student_head_VH.to(h_RH.dtype)).float()
        logp_RV = torch.log_softmax(logits_RV[:, :vocab_size], -1)
        loss_R, shown_R = rows(logp_RV, *served_R)
        entropy_R = -(logp_RV.exp() * logp_RV).sum(-1).detach()
        token_R = torch.log_softmax(logits_RV, -1).gather(1, target_R[:, None]).squeeze(1).detach()
        return loss_R, shown_R.detach(), entropy_R, token_R

    spans = [slice(s, s + chunk_size) for s in range(0, student_hidden_NH.shape[0], chunk_size)]
    parts = [
        checkpoint(chunk, student_hidden_NH[r], target_ids_N[r], *(t[r] for t in served), use_reentrant=False)
        for r in spans
    ]
    if not parts:
        zero = student_hidden_NH.sum() * 0.0
        empty = zero.new_zeros(0)
        return DivergenceOutput(zero, empty, empty, empty if want_target else None)
    loss_N, shown_N, entropy_N, token_N = (torch.cat(p) for p in zip(*parts))
    return DivergenceOutput(loss_N.sum(), shown_N, entropy_N, token_N if want_target else None)


def renormalised_rows(beta: float):
    """`chunked_student_rows`' rows for round and noise: the exact divergence between the student and the
    renormalised served log-probabilities (`loss.per_token_divergence` renormalises both)."""

    def rows(logp_RV, served_RV):
        div_R = per_token_divergence(logp_RV, served_RV, beta)
        return div_R, div_R

    return rows


def sampled_rows(logp_RV, teacher_logp_R, actual_R):
    """`chunked_student_rows`' rows for sampled: a loss with `sampled_token_loss`'s gradient whose value is
    the log-ratio log s - log t (the one-sample estimate of reverse KL, what metrics.jsonl's loss then
    shows), and that log-ratio as the logged divergence."""
    s_R = logp_RV.gather(1, actual_R[:, None]).squeeze(1)
    loss_R = sampled_token_loss(s_R, teacher_logp_R)
    ratio_R = (s_R - teacher_logp_R).detach()
    return loss_R - loss_R.detach() + ratio_R, ratio_R


class DefendedTeacher(Teacher):
    """A teacher in this process (`LocalTeacher` over `module`) whose scores reach the loss through a
    `Defence`; `seed` seeds the noise of noise:S. Its divergence is the attacker's loss on the defended
    scores (see the module's docstring), labelled as not the exact one in every step."""

    name = "defended teacher"
    exact = False
    gives_entropy = True
    another_tokenizer_refusal = (
        "teacher_defence needs a teacher with the student's tokenizer (the defended scores are of the "
        "student's tokens); set teacher_defence none for a teacher with another one."
    )

    def __init__(self, module: torch.nn.Module, defence: Defence | str, seed: int = 0):
        self.local = LocalTeacher(module)
        self.module = self.local.module
        self.defence = defence if isinstance(defence, Defence) else Defence.of(defence)
        self.seed = seed
        self.vocab: int | None = None
        self.generator: torch.Generator | None = None

    def start(self, student, tokenizer, args) -> None:
        self.local.start(student, tokenizer, args)
        if args.kl_temperature != 1.0:
            raise ValueError(
                TEMPERATURE_REFUSAL.format(spec=self.defence.spec, temperature=args.kl_temperature)
            )
        if self.defence.kind == "sampled" and args.beta != 1.0:
            raise ValueError(
                f"teacher_defence sampled at beta={args.beta:g}: the per-token log-ratio loss estimates "
                "reverse KL only; set beta 1, or another defence."
            )
        self.vocab = len(tokenizer)
        if args.process_index == 0:
            print(f"teacher_defence {self.defence.spec}: the loss reads the defended scores", flush=True)

    def place(self, device, shard: bool) -> None:
        self.local.place(device, shard)

    def score(self, record: RolloutRecord, own, fwd: dict, pred_BT: torch.Tensor):
        """The defended scores at the predicting positions (`Defence.serve`), and the scored tokens."""
        states = self.local.score(record, own, fwd, pred_BT)
        actual_N = fwd["input_ids"][:, 1:][pred_BT[:, :-1]]
        with torch.no_grad():
            logits_NV = F.linear(states.hidden_NH.float(), states.head_VH[: self.vocab].float())
            if self.generator is None or self.generator.device != logits_NV.device:
                self.generator = torch.Generator(logits_NV.device).manual_seed(self.seed)
            return self.defence.serve(logits_NV, actual_N, self.generator), actual_N

    def student_divergence(self, student, fwd, pred_BT, part, given: DivergenceInputs):
        served, actual_N = part
        kind = self.defence.kind
        if kind == "topk":
            return student_topk_divergence(student, fwd, pred_BT, *served, **given.one_vocabulary())
        s_hidden_NH, s_head_VH = student_states(student, fwd, pred_BT)
        rows, data = (
            (sampled_rows, (served, actual_N))
            if kind == "sampled"
            else (
                renormalised_rows(given.beta),
                (served,),
            )
        )
        with torch.autocast(s_hidden_NH.device.type, enabled=False):
            out = chunked_student_rows(
                s_hidden_NH,
                s_head_VH,
                rows,
                data,
                vocab_size=given.vocab_size,
                chunk_size=given.chunk_size,
                target_ids_N=given.target_ids_N,
            )
        return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N

    def metrics(self, sums) -> dict:
        return {"teacher_defence": self.defence.spec}

    def fingerprint(self, probe_ids: list[int]) -> dict:
        return {"teacher_defence": self.defence.spec}

    def check_same(self, saved: dict, now: dict) -> None:
        if saved.get("teacher_defence") != now["teacher_defence"]:
            raise ValueError(
                f"this run trained against teacher_defence {saved.get('teacher_defence')} and resumes with "
                f"{now['teacher_defence']}; resume with the same defence, or start a new run."
            )

    def describe(self, name: str) -> str | None:
        return f"teacher {name} in this process, its scores defended by teacher_defence {self.defence.spec}"


def defended(module: torch.nn.Module, spec: str, seed: int) -> torch.nn.Module | Teacher:
    """`module` behind `teacher_defence` `spec` (a `DefendedTeacher`), or as it is for none."""
    return module if spec == "none" else DefendedTeacher(module, spec, seed)
