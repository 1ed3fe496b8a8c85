"""02 over multi-turn transcripts (`environment`, the tiny tool world: every episode calls the calculator)
with the two served teacher kinds issue 48 builds there, against the stub server of
tests/test_opd_teachers_served.py (transformers' tiny teachers over HTTP): a served top-K teacher
(`teacher_logprobs topk:K`) is sent each transcript whole, and its first loss and update are the top-K
divergence computed here from the teacher's own logits at the positions predicting the student's tokens; a
served teacher of another tokenizer takes the in-process cross-tokenizer teacher's first update. (The exact
served teacher over transcripts: tests/test_jobs_whitebox_served.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import TOOL_RUN, StubPoolingServer, assert_grads_close, episodes, run_tiny, tool_turns
from transformers import AutoModelForCausalLM

from opdkit import tiny
from opdkit.models import load_tokenizer
from opdkit.opd.callbacks import GradientDump
from opdkit.opd.teachers import topk

K = 5
OVER = {**TOOL_RUN, "per_device_train_batch_size": 4}


def _model(name: str):
    return AutoModelForCausalLM.from_pretrained(tiny.resolve(name))


def direct_topk_step(run_path, k: int, student: str, teacher: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The first step's loss and gradient computed here: for each saved transcript (unpadded, alone), the
    teacher's log-softmax at each state predicting a token of loss mask 1 (the student's turns, several runs
    a row), its top-k with the actual token beside them, and the student's full logits there, through
    `topk_divergence` (beta 1), summed over the student's tokens and divided by their count."""
    s_model, t_model = _model(student), _model(teacher).eval()
    total, n = 0.0, 0
    for ids, mask in episodes(run_path):
        at = [t for t in range(len(ids) - 1) if mask[t + 1]]  # the state at t predicts token t+1
        s_TV = s_model(input_ids=torch.tensor([ids])).logits[0, at]
        with torch.no_grad():
            t_TV = t_model(input_ids=torch.tensor([ids])).logits[0, at]
        ids_TK, logp_TK = topk.teacher_topk(t_TV, k, torch.tensor(ids)[[t + 1 for t in at]])
        total = total + topk.topk_divergence(s_TV, ids_TK, logp_TK, beta=1.0).sum()
        n += len(at)
    loss = total / n
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in s_model.named_parameters()}


def test_a_served_topk_teacher_over_transcripts_is_the_teachers_topk_at_the_students_positions(tmp_path):
    """`teacher_logprobs topk:5` from the stub's prompt_logprobs: the transcripts sent are the episodes' rows
    whole (tool turns in each), and the first loss and gradient are `direct_topk_step`'s."""
    with StubPoolingServer(
        _model("tiny:teacher").eval(), "tiny:teacher", load_tokenizer("tiny:student")
    ) as stub:
        over = {**OVER, "teacher_server": stub.url, "teacher_logprobs": f"topk:{K}"}
        run = run_tiny(tmp_path, "topk", [GradientDump(str(tmp_path / "topk.pt"))], **over)
    rows = episodes(run.path)
    assert len(rows) == 4 and all(tool_turns(mask) >= 1 for _, mask in rows), "every episode calls the tool"
    sent = [r for p in stub.completion_requests[1:] for r in p["prompt"]]  # after the start check's probe
    assert sorted(sent) == sorted(list(ids) for ids, _ in rows)
    assert all(p["prompt_logprobs"] == K for p in stub.completion_requests)
    first = run.read_jsonl()[0]
    loss, grads = direct_topk_step(run.path, K, "tiny:teacher-tools", "tiny:teacher")
    assert first["loss"] == pytest.approx(loss, rel=1e-5)
    assert first["teacher_logprobs"] == f"topk:{K} (approximate)"
    assert_grads_close(torch.load(tmp_path / "topk.pt"), grads, rtol=1e-4)


def test_a_served_teacher_of_another_tokenizer_over_transcripts_takes_the_in_process_first_update(tmp_path):
    """tiny:teacher-bpe-tools (a byte-level BPE tokenizer) served by the stub, which reads its own tokens:
    each transcript, rendered by the teacher's chat template, is sent as the teacher's tokens, and the first
    loss and update are the in-process cross-tokenizer teacher's (relative 1e-5) on the same episodes."""
    cross = {
        **OVER,
        "teacher_model": "tiny:teacher-bpe-tools",
        "crosstok_hybrid": True,
        "crosstok_match": "bytes",
        "crosstok_skip_student_eos": False,
        "crosstok_skip_teacher_eos": False,
    }
    local = run_tiny(tmp_path, "local", [GradientDump(str(tmp_path / "local.pt"))], **cross)
    bpe_tok = load_tokenizer("tiny:teacher-bpe-tools")
    with StubPoolingServer(_model("tiny:teacher-bpe-tools").eval(), "teacher-bpe-tools", bpe_tok) as stub:
        over = {**cross, "teacher_server": stub.url, "teacher_server_dtype": "float32"}
        run = run_tiny(tmp_path, "served", [GradientDump(str(tmp_path / "served.pt"))], **over)
    rows = episodes(run.path)
    assert sorted(rows) == sorted(episodes(local.path)) and len(rows) == 4
    assert all(tool_turns(mask) >= 1 for _, mask in rows), "every episode calls the calculator"
    saved = torch.load(run.path / "rollouts" / "step000001-rank0.pt")
    teacher_rows = [
        ids[attn.bool()].tolist()
        for mb in saved
        for ids, attn in zip(mb["teacher_input_ids"], mb["teacher_attention_mask"])
    ]
    sent = [r for p in stub.pooling_requests[1:] for r in p["input"]]  # after the start check's probe
    assert sorted(sent) == sorted(teacher_rows)
    assert {tuple(r) for r in sent}.isdisjoint(
        ids for ids, _ in rows
    )  # the teacher's tokens, not the student's
    got, want = torch.load(tmp_path / "served.pt"), torch.load(tmp_path / "local.pt")
    for name, w in want.items():
        assert float((got[name] - w).norm() / w.norm()) < 1e-5, name
    assert run.read_jsonl()[0]["loss"] == pytest.approx(local.read_jsonl()[0]["loss"], rel=1e-5)
