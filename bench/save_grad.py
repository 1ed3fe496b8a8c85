"""P3 and P4: the proxy student's mean completion gradient, opdkit against the ADS original's algorithm.

    python -m bench.run --only P3,P4 --reps 5

Both sides get the same random Qwen3 proxy (float32, Qwen3's vocabulary) and the same traces: random token ids
with a prompt and a completion part and lengths spread like real reasoning traces, in generation order
(unsorted), at the same batch size. The baseline is the ADS `save_grad.py` loop, re-implemented here
faithfully (only here, never in the kit): left-padded batches in dataset order with labels -100 on
padding and prompt (what `DataCollatorForCompletionOnlyLM` builds), `model(**batch).loss` (the
batch's mean token loss) times the batch size, backward, a Python loop adding every `param.grad`
into a second full-size dict of zeros, `model.zero_grad()`, division by the trace count at the end.
opdkit is `opdkit.ads.gradient.mean_completion_grad`. Measured: peak RSS above the process's baseline
(taken after imports, proxy and traces) and completion tokens per second of wall time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from opdkit.models import small_qwen3

SIDES = ("opdkit", "ads")
BASELINE = "ADS save_grad.py algorithm (second accumulator, per-parameter loop, per-batch mean loss)"
IGNORE = -100


def default_params(quick: bool = False) -> dict[str, Any]:
    """A 42M-parameter Qwen3 proxy with Qwen3's vocabulary (hidden 256, 4 layers, 151,936 tokens, as a
    proxy sharing a Qwen teacher's tokenizer must have) on 48 traces of 64-320 tokens, batch 8 (the
    savegrad default)."""
    if quick:
        return dict(hidden=64, layers=2, vocab=512, traces=8, min_len=16, max_len=48, batch=4, seed=0)
    return dict(hidden=256, layers=4, vocab=151_936, traces=48, min_len=64, max_len=320, batch=8, seed=0)


def proxy(p: dict) -> torch.nn.Module:
    """A random Qwen3 proxy of the requested size, float32, tied embeddings, in train mode as the seed."""
    return small_qwen3(p["hidden"], p["layers"], p["vocab"], p["seed"], max_position_embeddings=4096)


def traces(p: dict) -> list[dict]:
    """Rows {"input_ids", "labels"}: a prompt of 1/8 of the length (at least 8 tokens), then the
    completion."""
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    rows = []
    for _ in range(p["traces"]):
        n = int(torch.randint(p["min_len"], p["max_len"] + 1, (1,), generator=gen))
        ids = torch.randint(1, p["vocab"], (n,), generator=gen).tolist()
        n_prompt = max(8, n // 8)
        rows.append({"input_ids": ids, "labels": [IGNORE] * n_prompt + ids[n_prompt:]})
    return rows


def completion_tokens(rows: list[dict]) -> int:
    return sum(sum(1 for t in r["labels"] if t != IGNORE) for r in rows)


def ads_collate(rows: list[dict], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """What the seed's collator gives with its left-padding tokenizer: padded ids, mask, completion labels."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[b, width - n :] = torch.tensor(r["input_ids"])
        mask[b, width - n :] = 1
        labels[b, width - n :] = torch.tensor(r["labels"])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def ads_mean_grad(model: torch.nn.Module, rows: list[dict], batch_size: int) -> dict[str, torch.Tensor]:
    """The ADS save_grad.py loop, single process (its accelerate calls are no-ops there)."""
    from torch.utils.data import DataLoader

    loader = DataLoader(rows, batch_size=batch_size, shuffle=False, collate_fn=ads_collate)
    grads = {
        name: torch.zeros_like(param.data) for name, param in model.named_parameters() if param.requires_grad
    }
    local_samples = 0
    model.train()
    for batch in loader:
        local_samples += batch["input_ids"].size(0)
        outputs = model(**batch)
        loss = outputs.loss * batch["input_ids"].size(0)
        loss.backward()
        for name, param in model.named_parameters():
            if param.requires_grad and param.grad is not None:
                grads[name].add_(param.grad)
        model.zero_grad()
    for name in grads:
        grads[name] = grads[name] / local_samples
    return grads


def opdkit_mean_grad(model: torch.nn.Module, rows: list[dict], batch_size: int) -> dict[str, torch.Tensor]:
    from opdkit.ads import gradient

    named, _ = gradient.mean_completion_grad(model, rows, "trace", batch_size=batch_size, pad_token_id=0)
    return named


def measure(side: str, p: dict) -> dict[str, Any]:
    """Peak RSS above the baseline and completion tokens/s of one side's whole gradient computation."""
    from bench.common import peak_bytes, reset_peak

    model, rows = proxy(p), traces(p)
    run = {"opdkit": opdkit_mean_grad, "ads": ads_mean_grad}[side]
    base = reset_peak()
    t0 = time.perf_counter()
    named = run(model, rows, p["batch"])
    wall = time.perf_counter() - t0
    peak = peak_bytes() - base
    n_params = sum(x.numel() for x in model.parameters())
    return {
        "peak_rss_gb": peak / 1e9,
        "tokens_per_s": completion_tokens(rows) / wall,
        "wall_s": wall,
        "grad_norm": float(torch.nn.utils.get_total_norm(list(named.values()))),
        "params_m": n_params / 1e6,
        "param_gb": n_params * 4 / 1e9,
        "completion_tokens": completion_tokens(rows),
    }
