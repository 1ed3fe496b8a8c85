"""P6: an optimizer step with the teacher served by a vLLM pooling server
(`opd.teachers.served.ServedTeacher`) against the same step with the teacher in the training process; P7:
bytes moved per token, the served teacher's exact hidden states against top-20 log-probabilities with ids from
a generation server.

    python -m bench.run --only P6 --reps 3        # P1b's size: 50M student, 113M teacher, 64 x 256 tokens
    python -m bench.run --only P7 --reps 1

P6's sides run the same `DistillTrainer` step as P1b's opdkit side (vLLM rollouts in the process, fp32,
micro-batches of 16); `served` saves the random teacher to a folder, serves it with
`python -m vllm.entrypoints.openai.api_server --runner pooling` on 127.0.0.1 (the same CPU: the server and
the trainer share its cores, as they would not on a real node), and scores through one POST /pooling per
micro-batch (the trainer as it is, without a `prepare_step` hook), the head read alone from the folder.
The server's start is outside the clock. Besides step time: the teacher phase split into the request
(server forward + transfer), the decoding, and the rest (placing the states), and the bytes per token.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

from bench import opd_step

SIDES = ("served", "local", "exact", "topk20")
BASELINE = "DistillTrainer with the teacher in the training process (P1b's opdkit side, vLLM rollouts)"
TOPK_BASELINE = "top-20 log-probabilities with ids, vLLM /v1/completions prompt_logprobs (JSON)"


def default_params(quick: bool = False) -> dict[str, Any]:
    from bench.registry import p1b_params

    # the server's KV cache: 64 sequences of ~290 tokens of the 113M teacher need ~0.6 GB (P1b's engine: 1.2)
    return {**p1b_params(quick), "server_kv_gb": 0.2 if quick else 1.2}


def _server(folder: str, runner: str, max_len: int, kv_gb: float, log: str, **kw):
    from opdkit.run.server import ServerProcess, free_port, vllm_command

    port = free_port()
    cmd = vllm_command(
        folder,
        port,
        runner=runner,
        dtype="float32",
        max_model_len=max_len,
        kv_cache_bytes=int(kv_gb * 1e9),
        enforce_eager=True,
        **kw,
    )
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", log, start_timeout_s=1200)


def measure(side: str, p: dict) -> dict[str, Any]:
    if side in ("exact", "topk20"):
        return _bytes_per_token(side, p)
    return _step(side, p)


def _step(side: str, p: dict) -> dict[str, Any]:
    from dataclasses import replace

    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from opdkit.opd.teachers.served import PoolingClient, ServedTeacher, TransferStats
    from opdkit.opd.teachers.served.head import load_head

    hf_logging.set_verbosity_error()
    tok, student, teacher = opd_step.load_models(p)
    prompts = opd_step.tiny_prompts(p["batch"] * (p["warmup"] + p["steps"] + 1), p["seed"])
    params_teacher = sum(x.numel() for x in teacher.parameters())
    marks: dict[str, TransferStats] = {}

    class TransferMarks(TrainerCallback):
        """The served teacher's transfer counters at the end of the warm-up and of the last step."""

        def on_step_end(self, args, state, control, **kwargs):
            if served is not None:
                marks["start" if state.global_step == p["warmup"] else "end"] = replace(served.stats)

    served, server = None, None
    with tempfile.TemporaryDirectory() as out_dir:
        if side == "served":
            folder = os.path.join(out_dir, "teacher")
            teacher.save_pretrained(folder)
            tok.save_pretrained(folder)
            server = _server(folder, "pooling", 4096, p["server_kv_gb"], os.path.join(out_dir, "server.log"))
            server.start()
            served = ServedTeacher(PoolingClient(server.url, timeout_s=600), load_head(folder), "float32")
            teacher = served
        try:
            probe = opd_step.StepProbe("opdkit-vllm", student, teacher, tok.eos_token_id)
            clock = opd_step._clock_callback(probe, p["warmup"])
            trainer = opd_step._opdkit_trainer(
                p, tok, student, teacher, prompts, out_dir, clock, engine="vllm"
            )
            trainer.add_callback(TransferMarks())
            trainer.train()
            trainer.close_engine()
        finally:
            if server is not None:
                server.stop()
    (t0, tok0, ph0), (t1, tok1, ph1) = clock.marks["start"], clock.marks["end"]
    wall, tokens, steps = t1 - t0, tok1 - tok0, p["steps"]
    phases = {k: (ph1[k] - ph0[k]) / steps for k in opd_step.StepProbe.PHASES}
    phases["rest"] = wall / steps - sum(phases.values())
    out = {
        "step_s": wall / steps,
        "tokens_per_s": tokens / wall,
        "tokens_per_step": tokens / steps,
        "phase_s": {k: round(v, 4) for k, v in phases.items()},
        "params_teacher": params_teacher,
    }
    if served is not None:
        a, b = marks["start"], marks["end"]
        sent = b.tokens - a.tokens
        out.update(
            server_start_s=server.start_s,
            requests_per_step=(b.requests - a.requests) / steps,
            tokens_sent_per_step=sent / steps,
            bytes_per_token=(b.bytes - a.bytes) / max(sent, 1),
            # the teacher phase of a step, split: the request (server forward + transfer), decoding the
            # answer, and the rest (finding the rows, placing the states)
            teacher_request_s=(b.request_s - a.request_s) / steps,
            teacher_decode_s=(b.decode_s - a.decode_s) / steps,
            state_gap=max(served.state_gaps) if served.state_gaps else None,
        )
    return out


def _bytes_per_token(side: str, p: dict) -> dict[str, Any]:
    """The tiny teacher served both ways; the same 64 tiny-task sequences (prompt + the teacher's greedy
    completion) sent in one request; bytes received per token."""
    from opdkit import tiny
    from opdkit.data.prompts import PromptCollator
    from opdkit.models import load_model, load_tokenizer
    from opdkit.opd.teachers.served import PoolingClient
    from opdkit.opd.teachers.topk import PromptLogprobsClient
    from opdkit.rollout import sampling
    from opdkit.tiny import task

    tok = load_tokenizer("tiny:student")
    teacher = load_model("tiny:teacher")
    batch = PromptCollator(tok, 64)(
        [{"messages": [{"role": "user", "content": q.prompt}]} for q in task.problems(64, p["seed"])]
    )
    r = sampling.sample(
        teacher,
        batch["prompts"],
        batch["prompt_attention_mask"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
        do_sample=False,
    )
    rows = [ids[m.bool()].tolist() for ids, m in zip(r.input_ids_BT, r.attention_mask_BT)]
    runner = "pooling" if side == "exact" else "generate"
    with tempfile.TemporaryDirectory() as out_dir:
        with _server(
            tiny.resolve("tiny:teacher"), runner, 256, 0.3, os.path.join(out_dir, "s.log")
        ) as server:
            t0 = time.perf_counter()
            if side == "exact":
                client = PoolingClient(server.url)
                client.hidden_states(rows)
            else:
                client = PromptLogprobsClient(server.url)
                client.topk(rows, 20)
            wall = time.perf_counter() - t0
    s = client.stats
    return {
        "bytes_per_token": s.bytes / s.tokens,
        "tokens": s.tokens,
        "hidden_size": teacher.config.hidden_size,
        "request_s": wall,
        "binary_bytes_per_token": teacher.config.hidden_size * 4 if side == "exact" else 21 * 8,
    }
