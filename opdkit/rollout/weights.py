"""The student's weights as they travel to a producer sampling ahead (`rollout.ahead`) and into a checkpoint:
one format, each tensor once under its name, the ties kept beside.

    w = Weights.copy_of(student)          # on the CPU: each tensor once (a tied embedding too), ties listed
    model.load_state_dict(w.on(device).state())       # every name, a tied one the same tensor as its twin
    engine.load(w.each())                 # each tensor once, as `named_parameters` lists them (vLLM)
    tensors, ties = w.flat("3/")          # for a safetensors file; `Weights.unflat` restores the ties
    logp_N = logprobs_under(model, w, fwd, pred_BT, target_N, chunk_size=1024)   # log p under w, no copy

Pitfall this module exists for: a state_dict names a tied tensor (the embedding and the head of Qwen3-0.6B or
the tiny student) twice. Sent or saved under each name it is two tensors, and a model fed two tensors no
longer ties them (a functional_call sees two weights, a load copies two values); `safetensors` refuses
shared tensors outright. So a tensor is held once, under the first name the state_dict lists it by (the one
`named_parameters` keeps), and every other name of it is a tie to that first name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Weights:
    """A model's state_dict as `tensors` (each tensor once, under its first name) and `ties` (every other
    name of a tensor -> the name it is held under)."""

    tensors: dict[str, torch.Tensor]
    ties: dict[str, str]

    @classmethod
    def copy_of(cls, model: torch.nn.Module) -> Weights:
        """The model's state_dict copied to the CPU, a tensor listed under several names copied once."""
        first: dict[tuple, str] = {}
        tensors, ties = {}, {}
        for name, t in model.state_dict().items():
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key in first:
                ties[name] = first[key]
            else:
                first[key] = name
                tensors[name] = t.detach().to("cpu", copy=True)
        return cls(tensors, ties)

    def state(self) -> dict[str, torch.Tensor]:
        """Every name of the state_dict, in its order where it was copied, a tie the same tensor object as
        the name it is tied to."""
        return {**self.tensors, **{name: self.tensors[to] for name, to in self.ties.items()}}

    def each(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor), each tensor once."""
        yield from self.tensors.items()

    def on(self, device) -> Weights:
        """The same weights on `device`, each tensor moved once."""
        return Weights({k: v.to(device) for k, v in self.tensors.items()}, dict(self.ties))

    def flat(self, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(tensors under `prefix` + name, ties likewise) for a file of several versions' weights."""
        tensors = {prefix + k: v.contiguous() for k, v in self.tensors.items()}
        return tensors, {prefix + k: prefix + v for k, v in self.ties.items()}

    @classmethod
    def unflat(cls, tensors: dict[str, torch.Tensor], ties: dict[str, str], prefix: str) -> Weights:
        """The weights `flat(prefix)` wrote, out of a file's tensors and ties."""
        n = len(prefix)
        own = {k[n:]: v for k, v in tensors.items() if k.startswith(prefix)}
        return cls(own, {k[n:]: v[n:] for k, v in ties.items() if k.startswith(prefix)})


@torch.no_grad()
def logprobs_under(
    model: torch.nn.Module,
    weights: Weights,
    fwd: dict,
    pred_BT: torch.Tensor,
    target_N: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """log p(target) at each position `pred_BT` marks, under `weights` (the model's, e.g. on the CPU) instead
    of the model's own, in float32: temperature 1, log-softmax over the whole head, as the engines report.
    One forward of the backbone (`torch.func.functional_call`, no copy of the model; each tensor moved once to
    the model's device, a tied one under both its names), then the head chunk by chunk (`chunk_size`
    positions), as the trainer's own log-probs. The moved weights are a transient copy of the model's
    weights on its device."""
    state = weights.on(next(model.parameters()).device).state()
    names = {m: n for n, m in model.named_modules()}
    base, head = model.base_model, model.get_output_embeddings()
    prefix = names[base] + "." if names[base] else ""
    inner = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    hidden_NH = torch.func.functional_call(base, inner, (), fwd).last_hidden_state[pred_BT].float()
    head_name = names[head] + "." if names[head] else ""
    head_VH = state[head_name + "weight"].float()
    bias_V = state.get(head_name + "bias")
    parts = []
    for h, t in zip(hidden_NH.split(chunk_size), target_N.split(chunk_size)):
        logits = torch.nn.functional.linear(h, head_VH, None if bias_V is None else bias_V.float())
        parts.append(logits.gather(1, t.unsqueeze(1)).squeeze(1) - logits.logsumexp(-1))
    return torch.cat(parts) if parts else hidden_NH.new_zeros(0)
