"""The proxy student's mean completion-only gradient: the math, the file it is saved in, the check on load.

    named, stats = mean_completion_grad(proxy, rows, "trace", batch_size=8, pad_token_id=0)  # every process
    save_grads(run.path, named, meta)                                      # grads.safetensors + grads.json
    g = load_grads(run.path, proxy, tokenizer)                             # names, shapes, tokenizer checked

`rows` are traces as `{"input_ids": [...], "labels": [...]}` (labels -100 outside the completion). The
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

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from opdkit.runs import atomic_write_text, json_safe
from opdkit.sft import IGNORE

NORMALIZATIONS = ("trace", "token")
GRADS_FILE = "grads.safetensors"
META_FILE = "grads.json"
META_KEY = "opdkit"  # the safetensors header entry that holds the metadata, so the file describes itself


class NonFiniteGradient(RuntimeError):
    """A trace whose loss or gradient is inf or NaN; nothing was saved."""


class GradsMismatch(ValueError):
    """A saved gradient that does not belong to the model or tokenizer it is loaded for."""


def completion_token_count(labels: Sequence[int]) -> int:
    return sum(1 for t in labels if t != IGNORE)


def shard_by_length(lengths: Sequence[int], rank: int, world: int) -> list[int]:
    """This process's trace indices: every `world`-th of the length-sorted order, so each trace is taken
    exactly once and every process gets a similar mix of lengths (a process may get none)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return order[rank::world]


def make_batches(
    rows: Sequence[dict], indices: Sequence[int], batch_size: int, pad_token_id: int, device: torch.device | str
) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches of consecutive `indices` (sorted by length, so padding stays small)."""
    for s in range(0, len(indices), batch_size):
        ids = list(indices[s : s + batch_size])
        width = max(len(rows[i]["input_ids"]) for i in ids)
        input_ids_BT = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
        labels_BT = torch.full((len(ids), width), IGNORE, dtype=torch.long)
        mask_BT = torch.zeros((len(ids), width), dtype=torch.long)
        for b, i in enumerate(ids):
            n = len(rows[i]["input_ids"])
            input_ids_BT[b, :n] = torch.tensor(rows[i]["input_ids"])
            labels_BT[b, :n] = torch.tensor(rows[i]["labels"])
            mask_BT[b, :n] = 1
        yield {
            "input_ids": input_ids_BT.to(device),
            "attention_mask": mask_BT.to(device),
            "labels": labels_BT.to(device),
            "trace_ids": torch.tensor(ids),
        }


def token_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion-token loss per trace, completion tokens per trace), both of shape B.

    Per-token cross-entropy over shifted logits with `reduction="none"`: padded and prompt positions
    carry label -100 and contribute exactly zero, whatever the batch looks like.
    """
    logits_BTV = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # Position t predicts token t+1: shift the labels, not the logits, whose shifted copy would be the
    # largest tensor of the step at a 151k vocabulary. The last position predicts nothing (-100).
    labels_BT = shifted_labels(batch["labels"])
    loss_N = F.cross_entropy(logits_BTV.flatten(0, 1).float(), labels_BT.flatten(), ignore_index=IGNORE, reduction="none")
    return loss_N.view_as(labels_BT).sum(dim=1), (labels_BT != IGNORE).sum(dim=1)


def trace_weights(n_tokens_B: torch.Tensor, normalization: str, total_traces: int, total_tokens: int) -> torch.Tensor:
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


def shifted_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (position t predicts token t+1); the last predicts nothing."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE)


def weighted_completion_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], weights_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed completion-token loss per trace, detached; sum over traces of weight x that, to backward).

    The cross-entropy runs from the final hidden states of completion positions only, a chunk of rows
    at a time, and the head's gradient is formed in the same pass (`_HeadCrossEntropy`): no B x T x V
    logits exist. Models whose head is not a plain bias-free linear map go through full logits.
    """
    if not _plain_head(model):
        loss_sum_B, _ = token_losses(model, batch)
        return loss_sum_B.detach(), (loss_sum_B * weights_B.to(loss_sum_B.dtype)).sum()
    no_logits = torch.empty(0, dtype=torch.long, device=batch["input_ids"].device)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=no_logits,
                output_hidden_states=True)  # fmt: skip
    labels_BT = shifted_labels(batch["labels"])
    keep_BT = labels_BT != IGNORE
    trace_N = keep_BT.nonzero()[:, 0]
    loss_N, loss = _HeadCrossEntropy.apply(
        out.hidden_states[-1][keep_BT], model.get_output_embeddings().weight, labels_BT[keep_BT],
        weights_B.to(trace_N.device)[trace_N],
    )  # fmt: skip
    loss_sum_B = torch.zeros(len(weights_B), dtype=loss_N.dtype, device=loss_N.device).index_add_(0, trace_N, loss_N)
    return loss_sum_B, loss


def _plain_head(model: torch.nn.Module) -> bool:
    """True when logits are exactly final_hidden @ head.weight.T (no bias, scale or soft-capping)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    cfg = getattr(model, "config", None)
    scaled = any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale",
                                                                   "logits_scaling", "output_multiplier"))  # fmt: skip
    return isinstance(head, torch.nn.Linear) and head.bias is None and not scaled


# Rows of one cross-entropy chunk: about this many bytes of float32 logits (256 MiB: 441 rows at Qwen's 151,936).
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
            h_CH = hidden_NH[c].to(dtype)
            logits_CV = F.linear(h_CH, w_VH)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            target_C = targets_N[c].unsqueeze(1)
            loss_N[c] = lse_C - logits_CV.gather(1, target_C).squeeze(1)
            grad_CV = logits_CV.sub_(lse_C.unsqueeze(1)).exp_()  # softmax, in place
            grad_CV.scatter_add_(1, target_C, torch.full_like(target_C, -1, dtype=dtype))
            grad_CV.mul_(row_weight_N[c].to(dtype).unsqueeze(1))
            grad_h_NH[c] = grad_CV @ w_VH
            grad_w_VH.addmm_(grad_CV.T, h_CH)
            del logits_CV, grad_CV
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
    local, error = _local_pass(model, batches, normalization, len(rows), sum(tokens), progress, -(-len(mine) // batch_size))
    if _any_process(error is not None, world, device):  # every process stops, not only the one that failed
        raise error or NonFiniteGradient("another process found a trace with a non-finite loss or gradient; see its error.")
    all_reduce_grads(model, world)
    named = {name: p.grad.detach() for name, p in model.named_parameters()}
    norm = global_norm(named)
    if not math.isfinite(norm):
        raise NonFiniteGradient(f"the summed gradient is non-finite (norm {norm}) although every trace's was finite; nothing was saved.")
    loss = _sum_over_processes(local, world, device)
    return named, {"num_traces": len(rows), "completion_tokens": sum(tokens), "loss": loss, "grad_norm": norm}


def _local_pass(model: torch.nn.Module, batches: Iterable, *args: Any) -> tuple[float, NonFiniteGradient | None]:
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
        raise ValueError("no traces to compute a gradient on; expected at least one (check the holdout size).")
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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what makes token ids mean something: vocabulary, special tokens, chat template."""
    facts = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
        "eos": tokenizer.eos_token,
        "bos": tokenizer.bos_token,
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(facts, ensure_ascii=False).encode()).hexdigest()[:16]


def save_grads(directory: str | Path, named: dict[str, torch.Tensor], meta: dict) -> Path:
    """Write `grads.safetensors` (fp32, metadata in its header) and `grads.json`, each atomically."""
    directory = Path(directory)
    path = directory / GRADS_FILE
    tensors = {name: g.detach().to("cpu", torch.float32).contiguous() for name, g in named.items()}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata={META_KEY: json.dumps(json_safe(meta))})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_text(directory / META_FILE, json.dumps(json_safe(meta), indent=2))
    return path


def _grads_path(path: str | Path) -> Path:
    path = Path(path)
    file = path / GRADS_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no saved gradient at {file}; expected the {GRADS_FILE} that 01_save_grad writes in its run "
            "directory, so pass that run directory (or the file)."
        )
    return file


def check_grads(path: str | Path, model: torch.nn.Module, tokenizer: Any = None) -> dict:
    """Check a saved gradient against `model` (names, shapes) and `tokenizer` (fingerprint) without
    reading the tensors; returns its metadata. `model` may live on the meta device."""
    file = _grads_path(path)
    with safe_open(str(file), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    _check_names(file, shapes, expected, meta)
    wrong = [(k, shapes[k], expected[k]) for k in expected if shapes[k] != expected[k]]
    if wrong:
        k, got, want = wrong[0]
        raise GradsMismatch(
            f"{file} does not fit this model: {len(wrong)} tensor(s) have other shapes, e.g. {k} is {got} in "
            f"the file but {want} in the model; it was computed for {meta.get('proxy_model', 'another model')}."
        )
    _check_fingerprint(file, meta, tokenizer if tokenizer is not None else _model_tokenizer(model))
    return meta


def _check_names(file: Path, shapes: dict, expected: dict, meta: dict) -> None:
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if not missing and not extra:
        return
    hint = ""
    if extra and all(k.startswith("module.") for k in extra):
        hint = " Its names carry DDP's `module.` prefix (the ADS seed's format); recompute it with 01_save_grad."
    raise GradsMismatch(
        f"{file} does not fit this model: {len(missing)} parameter(s) have no gradient (e.g. {missing[:2]}) and "
        f"{len(extra)} gradient(s) match no parameter (e.g. {extra[:2]}); it was computed for "
        f"{meta.get('proxy_model', 'another model')}, so load the proxy it was computed for.{hint}"
    )


def _model_tokenizer(model: torch.nn.Module) -> Any:
    """The tokenizer stored next to a model loaded from a local folder; None when there is none."""
    folder = getattr(model, "name_or_path", "") or getattr(getattr(model, "config", None), "_name_or_path", "")
    if not folder or not Path(folder).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None


def _check_fingerprint(file: Path, meta: dict, tokenizer: Any) -> None:
    if tokenizer is None:
        import warnings

        warnings.warn(f"tokenizer not checked against {file}: pass tokenizer= to load_grads.", stacklevel=3)
        return
    got, want = tokenizer_fingerprint(tokenizer), meta.get("tokenizer_fingerprint")
    if got != want:
        raise GradsMismatch(
            f"{file} was computed with another tokenizer (fingerprint {want}, this one {got}); token ids would "
            f"mean different things, so use the tokenizer of {meta.get('proxy_model', 'the proxy it was computed for')}."
        )


def load_grads(
    path: str | Path, model: torch.nn.Module, tokenizer: Any = None, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The saved gradient as {parameter name: fp32 tensor}, after `check_grads` against model and tokenizer.

    Without `tokenizer`, the one saved next to the model's local folder is used (else only warned about).
    """
    check_grads(path, model, tokenizer)
    with safe_open(str(_grads_path(path)), framework="pt", device=str(device)) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def read_meta(path: str | Path) -> dict:
    """The metadata of a saved gradient (the grads.json next to it, or the file's header)."""
    file = _grads_path(path)
    side = file.with_name(META_FILE)
    if side.is_file():
        return json.loads(side.read_text())
    with safe_open(str(file), framework="pt") as f:
        return json.loads((f.metadata() or {}).get(META_KEY, "{}"))
