"""How the models are spread over processes: DDP (replicated) or FSDP2 (sharded; the frozen teacher
too, with `shard_frozen`), and the one rule both impose on a loss that reads a model's weights directly.

    args = TrainingArguments(..., **fsdp_arguments("fsdp", world_size))
    loss = call_inside_forward(wrapped_model, student, loss_fn, inputs)
    shard_frozen(teacher)   # then its parts run inside its own forward too: call_inside_forward(teacher, ...)

Pitfalls this module exists for:
- under FSDP a parameter is a shard (a DTensor) except between the pre- and post-forward hooks of
  its module; a loss that multiplies hidden states by `student.lm_head.weight` after the model's
  forward has returned reads a shard, or an unsharded copy that FSDP has stopped tracking. Under DDP
  the forward prepares the gradient all-reduce. `call_inside_forward` runs the whole student part of
  the loss as the wrapped module's forward, so both wrappers' hooks enclose it;
- accelerate 1.15 honours an FSDP plugin only on accelerators: on CPU its state stays MULTI_CPU and
  the plugin is dropped, so the model would silently be wrapped in DDP. FSDP2's `fully_shard` itself
  runs over gloo; `treat_cpu_processes_as_fsdp` sets the two fields accelerate's state sets on GPUs,
  so the CPU tests run accelerate's own FSDP2 code (`fsdp2_prepare_model`, clipping, full state dicts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

T = TypeVar("T")

# FSDP2 through accelerate, as the original's accelerate FSDP run: every decoder layer its own unit
# (the model's `_no_split_modules`, e.g. Qwen3DecoderLayer), parameters resharded after forward, and
# a full state dict on save so `model/` and checkpoints are ordinary Hugging Face folders.
FSDP_CONFIG = {
    "version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "reshard_after_forward": True,
    "state_dict_type": "FULL_STATE_DICT",
}


def fsdp_arguments(parallelism: str, world_size: int) -> dict[str, Any]:
    """TrainingArguments fields for `parallelism` ("ddp" or "fsdp"); one process has nothing to shard."""
    if parallelism == "fsdp" and world_size > 1:
        return {"fsdp": True, "fsdp_config": dict(FSDP_CONFIG)}
    return {}


def call_inside_forward(wrapper: nn.Module, inner: nn.Module, fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)`, run as `inner`'s forward through `wrapper(*args, **kwargs)`.

    `wrapper` is what the trainer prepared: a DDP module around `inner`, the FSDP2 root (then
    `inner is wrapper`), or `inner` itself in one process. Its forward hooks run around `fn`, so
    every parameter `fn` touches, also one it reads directly such as a tied lm_head weight, is
    unsharded while `fn` runs and its gradient is reduced like any other. `fn` may call `inner`'s
    submodules (the backbone) but not `inner` itself: the redirection is undone before `fn` runs.
    """
    patched = "forward" in inner.__dict__  # e.g. accelerate's autocast wrapper around forward
    original = inner.__dict__.get("forward")

    def restore() -> None:
        if patched:
            inner.forward = original
        elif "forward" in inner.__dict__:
            del inner.forward

    def redirected(*a, **k):
        restore()
        return fn(*a, **k)

    inner.forward = redirected
    try:
        return wrapper(*args, **kwargs)
    finally:
        restore()


def treat_cpu_processes_as_fsdp(accelerator, fsdp_plugin_args: dict) -> bool:
    """On CPU, make accelerate's state FSDP as it would be on GPUs; True if it changed anything.

    Only what `AcceleratorState.__init__` sets for an FSDP plugin on accelerators: `distributed_type`
    and `fsdp_plugin` (with its mixed precision). Everything after that (sharding with
    `fully_shard`, clipping, state dicts) is accelerate's and torch's own code.
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if accelerator.device.type != "cpu" or state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin(**fsdp_plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    AcceleratorState._shared_state["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def keep_fp32_outputs(fsdp_plugin) -> None:
    """Drop the output cast from accelerate's FSDP2 mixed-precision policy (bf16 params and reductions
    stay): with it, the root's forward would hand back the float32 loss, and so its gradient, in bf16.
    FSDP1, the original's engine, never cast outputs."""
    import dataclasses

    policy = getattr(fsdp_plugin, "mixed_precision_policy", None)
    if policy is not None and getattr(policy, "output_dtype", None) is not None:
        fsdp_plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)


def shard_frozen(model: nn.Module) -> nn.Module:
    """`model` frozen and sharded with FSDP2 over every process, as the student is: each decoder layer
    (the model's `_no_split_modules`) its own unit, then the root (embedding, final norm, head), all
    resharded after forward. No optimizer ever sees it, so nothing but its weights is sharded. Its
    forward is then a collective: every rank must call it in step, through the root (`call_inside_forward`
    for a part such as the backbone alone)."""
    from torch.distributed.fsdp import fully_shard

    model.eval().requires_grad_(False)
    units = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in units:
            fully_shard(module, reshard_after_forward=True)
    return fully_shard(model, reshard_after_forward=True)


def is_sharded(model: nn.Module) -> bool:
    """Whether `model` is an FSDP2 module, whose every forward is a collective."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered to its full value (a collective: every rank must call it); else `t`."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
