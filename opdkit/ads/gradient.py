"""The proxy student's mean completion-only gradient (savegrad's), over the completion tokens the rows label.

    named, stats = mean_completion_grad(proxy, rows, "trace", batch_size=8, pad_token_id=0)  # every process
    save_grads(run.path, named, meta)                                      # grads.safetensors + grads.json
    g = load_grads(run.path, proxy, tokenizer)                             # names, shapes, tokenizer checked

`rows` are traces as `{"input_ids": [...], "labels": [...]}` (labels -100 outside the completion, or
outside the kinds of completion token kept: `ads.tokenkinds`, for the gradient variants). The
saved gradient is, for `normalization="trace"`, the mean over traces of the gradient of each trace's
mean token loss (what the ADS `save_grad.py` computes at batch size 1) and, for `"token"`, the gradient
of the loss summed over every completion token divided by their number. Each trace's loss is scaled by
its share of that mean *before* `backward`, so the sum of all backward passes in all processes is the
mean itself: no batch size, padding or process count enters the result.

Pitfalls this module exists for (all of them in the ADS seed):
- the gradient accumulates in the parameters' own `.grad` and is summed across processes with an
  explicit `all_reduce(SUM)`; no DDP wrapper, so nothing averages behind our back and no key carries a
  `module.` prefix;
- traces are split across processes by position in a length-sorted list, each exactly once (a process
  may get none); nothing is repeated to even out batches;
- a non-finite loss or gradient stops the run naming the trace, in every process, before any file is
  written.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

from opdkit import memory
from opdkit.data.labels import IGNORE, make_batches, shifted_labels, token_losses

NORMALIZATIONS = ("trace", "token")


class NonFiniteGradient(RuntimeError):
    """A trace whose loss or gradient is inf or NaN; nothing was saved."""


def completion_token_count(labels: Sequence[int]) -> int:
    return sum(1 for t in labels if t != IGNORE)


def shard_by_length(lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """This process's trace indices: every `world`-th of the length-sorted order, so each trace is taken
    exactly once and every process gets a similar mix of lengths (a process may get none)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return order[rank::world]


def trace_weights(
    n_tokens_B: torch.Tensor, normalization: str, total_traces: int, total_tokens: int
) -> torch.Tensor:
    """Each trace's factor on its summed token loss, chosen so that all traces together give the mean.

    trace: 1 / (its completion tokens x all traces); token: 1 / all completion tokens.
    """
    if normalization == "trace":
        return 1.0 / (n_tokens_B.double() * total_traces)
    if normalization == "token":
        return torch.full_like(n_tokens_B, 1.0 / total_tokens, dtype=torch.float64)
    raise ValueError(f"normalization={normalization!r} is not one of {list(NORMALIZATIONS)}.")


def accumulate_mean_grad(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    normalization: str,
    total_traces: int,
    total_tokens: int,
    progress: bool = False,
    num_batches: int | None = None,
) -> float:
    """Add this process's share of the mean gradient into every parameter's `.grad`; returns its share of
    the mean loss. Raises NonFiniteGradient naming the trace whose loss or gradient is inf or NaN."""
    objective = 0.0
    for batch in tqdm(batches, total=num_batches, desc="proxy gradient", disable=not progress):
        n_tokens_B = (shifted_labels(batch["labels"]) != IGNORE).sum(dim=1)
        weights_B = trace_weights(n_tokens_B, normalization, total_traces, total_tokens)
        loss_sum_B, loss = weighted_completion_loss(model, batch, weights_B)
        bad = ~torch.isfinite(loss_sum_B.detach())
        if bad.any():
            trace = int(batch["trace_ids"][bad.nonzero()[0, 0].item()])
            raise NonFiniteGradient(_nonfinite_message(trace, "loss"))
        loss.backward()
        objective += loss.item()
        if not _grads_finite(model):
            raise NonFiniteGradient(_nonfinite_message(_first_nonfinite_trace(model, batch), "gradient"))
    return objective


def weighted_completion_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], weights_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion-token loss per trace, detached; sum over traces of weight x that, to backward).

    The cross-entropy runs from the final hidden states of completion positions only, a chunk of rows
    at a time, and the head's gradient is formed in the same pass (`_HeadCrossEntropy`): no B x T x V
    logits exist. Models whose head is not a plain bias-free linear map go through full logits.
    """
    if not plain_head(model):
        loss_sum_B, _ = token_losses(model, batch)
        return loss_sum_B.detach(), (loss_sum_B * weights_B.to(loss_sum_B.dtype)).sum()
    no_logits = torch.empty(0, dtype=torch.long, device=batch["input_ids"].device)
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        logits_to_keep=no_logits,
        output_hidden_states=True,
    )
    labels_BT = shifted_labels(batch["labels"])
    keep_BT = labels_BT != IGNORE
    trace_N = keep_BT.nonzero()[:, 0]
    loss_N, loss = _HeadCrossEntropy.apply(
        out.hidden_states[-1][keep_BT],
        model.get_output_embeddings().weight,
        labels_BT[keep_BT],
        weights_B.to(trace_N.device)[trace_N],
    )
    loss_sum_B = torch.zeros(len(weights_B), dtype=loss_N.dtype, device=loss_N.device).index_add_(
        0, trace_N, loss_N
    )
    return loss_sum_B, loss


def plain_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly final_hidden @ head.weight.T (no bias, scale or soft-capping)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    scaled = any(
        getattr(cfg, k, None) not in (None, 1.0)
        for k in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
    )
    return isinstance(head, torch.nn.Linear) and head.bias is None and not scaled


# Rows of one cross-entropy chunk: about this many bytes of float32 logits
# (256 MiB: 441 rows at Qwen's 151,936).
_CHUNK_BYTES = 2**28


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of hidden_NH @ weight_VH.T against targets_N, and sum(weight_N * loss_N).

    The row weights are known before backward, so each chunk's logits become their gradient in place
    (softmax - one-hot, times the row weight) right after the loss is read off, and the hidden states'
    and the head's gradients are formed then: one chunk x V buffer and three matmuls per chunk, as
    autograd would run, without keeping or recomputing logits. Backward only scales them by the
    incoming gradient of the weighted sum (a scalar).
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, row_weight_N):
        dtype = torch.promote_types(weight_VH.dtype, torch.float32)
        loss_N = torch.empty(hidden_NH.shape[0], dtype=dtype, device=hidden_NH.device)
        grad_h_NH = torch.zeros(hidden_NH.shape, dtype=dtype, device=hidden_NH.device)
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=dtype, device=weight_VH.device)
        w_VH = weight_VH.to(dtype)
        rows = max(1, _CHUNK_BYTES // (4 * weight_VH.shape[0]))
        for start in range(0, hidden_NH.shape[0], rows):
            c = slice(start, start + rows)
            h_RH = hidden_NH[c].to(dtype)
            logits_RV = F.linear(h_RH, w_VH)
            lse_R = torch.logsumexp(logits_RV, dim=-1)
            target_R = targets_N[c].unsqueeze(1)
            loss_N[c] = lse_R - logits_RV.gather(1, target_R).squeeze(1)
            grad_RV = logits_RV.sub_(lse_R.unsqueeze(1)).exp_()  # softmax, in place
            grad_RV.scatter_add_(1, target_R, torch.full_like(target_R, -1, dtype=dtype))
            grad_RV.mul_(row_weight_N[c].to(dtype).unsqueeze(1))
            grad_h_NH[c] = grad_RV @ w_VH
            grad_w_VH.addmm_(grad_RV.T, h_RH)
            del logits_RV, grad_RV
        ctx.grads = (grad_h_NH.to(hidden_NH.dtype), grad_w_VH.to(weight_VH.dtype))
        ctx.mark_non_differentiable(loss_N)
        return loss_N, (loss_N * row_weight_N.to(dtype)).sum()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _grad_loss_N, grad_loss):
        grad_h_NH, grad_w_VH = ctx.grads
        del ctx.grads  # so autograd can take these tensors over instead of copying them
        if grad_loss.item() != 1.0:
            grad_h_NH.mul_(grad_loss)
            grad_w_VH.mul_(grad_loss)
        return grad_h_NH, grad_w_VH, None, None


def _nonfinite_message(trace: int, what: str) -> str:
    return (
        f"trace {trace} (row {trace} of the traces dataset) gives a non-finite {what}; nothing was saved. "
        "Look at that trace (an empty or garbled completion?) and at the proxy's weights, drop the trace "
        "or fix the model, and run again."
    )


def _finite(grads: list[torch.Tensor]) -> bool:
    return not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))


def _grads_finite(model: torch.nn.Module) -> bool:
    return _finite([p.grad for p in model.parameters() if p.grad is not None])


def _first_nonfinite_trace(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Re-run the batch's traces one at a time to find which one makes the gradient non-finite."""
    params = [p for p in model.parameters() if p.requires_grad]
    for b, trace in enumerate(batch["trace_ids"].tolist()):
        one = {k: v[b : b + 1] for k, v in batch.items() if k != "trace_ids"}
        loss_sum_B, _ = token_losses(model, one)
        grads = torch.autograd.grad(loss_sum_B.sum(), params, allow_unused=True)
        if not _finite([g for g in grads if g is not None]):
            return trace
    return int(batch["trace_ids"][0])  # only the sum overflowed: name the batch's first trace


def all_reduce_grads(model: torch.nn.Module, world: int) -> None:
    """Sum every `.grad` over processes (a parameter no trace reached gets a zero gradient first)."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if world > 1:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def _any_process(flag: bool, world: int, device: torch.device | str) -> bool:
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _sum_over_processes(value: float, world: int, device: torch.device | str) -> float:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item()


def mean_completion_grad(
    model: torch.nn.Module,
    rows: Sequence[dict],
    normalization: str,
    batch_size: int,
    pad_token_id: int,
    rank: int = 0,
    world: int = 1,
    progress: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The mean completion-only gradient over all `rows`, identical in every process.

    Every process passes the same `rows`; each computes the traces of its shard, then the `.grad`s are
    summed across processes. Returns ({parameter name: gradient}, {traces, tokens, loss, grad_norm}).
    """
    tokens = [completion_token_count(r["labels"]) for r in rows]
    _check_rows(rows, tokens, normalization)
    device = next(model.parameters()).device
    mine = shard_by_length([len(r["input_ids"]) for r in rows], rank, world)
    batches = make_batches(rows, mine, batch_size, pad_token_id, device)
    local, error = _local_pass(
        model, batches, normalization, len(rows), sum(tokens), progress, -(-len(mine) // batch_size)
    )
    if _any_process(error is not None, world, device):  # every process stops, not only the one that failed
        raise error or NonFiniteGradient(
            "another process found a trace with a non-finite loss or gradient; see its error."
        )
    all_reduce_grads(model, world)
    named = {name: p.grad.detach() for name, p in model.named_parameters()}
    norm = global_norm(named)
    if not math.isfinite(norm):
        raise NonFiniteGradient(
            f"the summed gradient is non-finite (norm {norm}) although every trace's was finite; "
            "nothing was saved."
        )
    loss = _sum_over_processes(local, world, device)
    return named, {"num_traces": len(rows), "completion_tokens": sum(tokens), "loss": loss, "grad_norm": norm}


def _local_pass(
    model: torch.nn.Module, batches: Iterable, *args: Any
) -> tuple[float, NonFiniteGradient | None]:
    """This process's share, from fresh `.grad`s; a non-finite trace is returned, not raised, so that
    every process can learn of it before anyone waits in a collective."""
    model.eval()  # gradients still flow; eval only turns dropout off, so the gradient is deterministic
    model.zero_grad(set_to_none=True)
    try:
        return accumulate_mean_grad(model, batches, *args), None
    except NonFiniteGradient as exc:
        return 0.0, exc


def _check_rows(rows: Sequence[dict], tokens: Sequence[int], normalization: str) -> None:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} is not one of {list(NORMALIZATIONS)}.")
    if not rows:
        raise ValueError(
            "no traces to compute a gradient on; expected at least one (check the holdout size)."
        )
    empty = [i for i, n in enumerate(tokens) if n == 0]
    if empty:
        raise ValueError(
            f"trace(s) {empty[:5]} have no completion tokens (every label is -100); their mean loss is "
            "undefined, so drop them or check that the chat template marks the assistant's answer."
        )


def global_norm(named: dict[str, torch.Tensor]) -> float:
    return float(torch.nn.utils.get_total_norm(list(named.values())).item()) if named else 0.0


def tensor_norms(named: dict[str, torch.Tensor]) -> dict[str, float]:
    return {name: float(g.float().norm().item()) for name, g in named.items()}


_LAYER = re.compile(r"^(.*?\.\d+)\.")


def norms_by_layer(norms: dict[str, float]) -> dict[str, float]:
    """Per-tensor norms grouped by layer (`model.layers.3.mlp.up_proj.weight` -> `model.layers.3`);
    tensors outside numbered layers keep their own name without `.weight`. Groups in first-seen order."""
    sq: dict[str, float] = {}
    for name, norm in norms.items():
        m = _LAYER.match(name)
        group = m.group(1) if m else re.sub(r"\.(weight|bias)$", "", name)
        sq[group] = sq.get(group, 0.0) + norm**2
    return {k: v**0.5 for k, v in sq.items()}


def gradient_stage(
    proxy_model: str, batch_size: int, prompt_len: int, completion_len: int, gpu: bool
) -> memory.Stage:
    """What one process holds while it takes the fp32 proxy's gradient on `batch_size` traces at a time (no
    optimizer; every process holds the whole proxy), for the memory plan."""
    return memory.Stage(
        student=memory.ModelShape.from_config(proxy_model),
        student_dtype="float32",
        bf16=False,
        device="cuda" if gpu else "cpu",
        optimizer="none",
        train_batch_size=batch_size,
        prompt_len=prompt_len,
        completion_len=completion_len,
    )
