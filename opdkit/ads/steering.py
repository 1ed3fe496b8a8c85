"""What ADS samples and scores with: the teacher, the fp32 proxy with its gradients (one or more kinds: the
completion gradient savegrad saves, the answer-token gradient), and the ADS direction of the gradient in use.

    steering = Steering(teacher, proxy, {"completion": g}, method="fd", eps=1e-2, device=dev)
    direction = steering.direction("completion")       # built once (two perturbed proxy copies for fd)
    steering.offload(True)                              # on a GPU: everything waits in host memory

The proxy and its gradients stay in host memory; a direction's perturbed copies go to `device` when built, one
gradient's at a time (building another frees the first), since two fp32 copies of a 3B proxy are 24 GB.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from opdkit.ads.direction import Direction, make_direction
from opdkit.ads.gradient import global_norm


@dataclass
class Steering:
    """The teacher (on `device`), the fp32 proxy (host memory) with its gradients by kind, and the direction
    of the gradient in use."""

    teacher: torch.nn.Module
    proxy: torch.nn.Module
    grads: dict[str, dict[str, torch.Tensor]]  # kind ("completion", "answer") -> {parameter name: gradient}
    method: str  # "fd" or "jvp" (`settings.ADS_METHODS`)
    eps: float
    device: torch.device
    directions: dict[str, Direction] = field(default_factory=dict)

    def direction(self, gradient: str) -> Direction:
        """The ADS direction of the `gradient` kind, built on `device` when first asked for."""
        if gradient not in self.directions:
            self.directions.clear()  # free the other gradient's copies first
            built = make_direction(self.method, self.proxy, self.grads[gradient], self.eps)
            self.directions[gradient] = built.to(self.device)
        return self.directions[gradient]

    def grad_norms(self) -> dict[str, float]:
        return {k: global_norm(g) for k, g in self.grads.items()}

    def offload(self, off: bool) -> None:
        """On a GPU, the teacher and the directions' copies wait in host memory (`off`) while something else
        uses the device (a 7B teacher, two fp32 3B proxies and a 3B student with AdamW states do not fit one
        80 GB GPU together), and come back; on a CPU nothing moves."""
        if self.device.type != "cuda":
            return
        target = "cpu" if off else self.device
        self.teacher.to(target)
        for direction in self.directions.values():
            direction.to(target)
        torch.cuda.empty_cache()
