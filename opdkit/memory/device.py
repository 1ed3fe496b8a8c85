"""What this machine has and what a process holds: the visible GPU's memory (read without initialising
CUDA), the host's, whether torch's CPU bf16 decoding copies the head per row, and the held-params record."""

from __future__ import annotations

import gc
import os
import subprocess
from collections.abc import Mapping
from typing import Any

from opdkit.config import ConfigError
from opdkit.memory.shapes import GB, dtype_name

HELD_DIR = "held"  # a run folder's record of what each process holds after loading: held/rank<k>.json


def visible_gpu_memory_gb() -> float | None:
    """The first visible GPU's memory in GB (1e9 B), None without a GPU. Read through NVML or nvidia-smi,
    which leave CUDA uninitialised, so that a notebook can still fork one process per GPU afterwards."""
    import torch

    count = torch.cuda.device_count()  # NVML-based where it can be: safe before a fork
    if count == 0:
        return None
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        out = subprocess.run(
            ["nvidia-smi", "-i", first, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(out.split()[0]) * 2**20 / GB  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    if count == 1:  # one process, no fork to protect: CUDA may be initialised here
        return torch.cuda.get_device_properties(0).total_memory / GB
    raise ConfigError(
        f"{count} GPUs are visible but their memory could not be read without initialising CUDA (no "
        "nvidia-smi); set plan_gpu_memory_gb to one GPU's memory in GB, e.g. plan_gpu_memory_gb=80."
    )


def budget_gb(plan_gpu_memory_gb: float) -> float | None:
    """The memory one process's plan must fit: `plan_gpu_memory_gb` when set, else the visible GPU's; None
    (nothing enforced) on a CPU without it."""
    return plan_gpu_memory_gb if plan_gpu_memory_gb > 0 else visible_gpu_memory_gb()


def card_gb() -> float | None:
    """The visible GPU's memory in GB, None when there is none or it cannot be read without CUDA."""
    try:
        return visible_gpu_memory_gb()
    except ConfigError:
        return None


def host_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def cpu_bf16_head_copies() -> bool:
    """Whether this host's torch copies the head once per row in a bf16 decoding step on CPU: oneDNN takes
    its bf16 matmuls (AVX512-BF16 or AMX), and makes the head expanded to every row contiguous; an AVX2-only
    CPU's BLAS bmm reads it in place (measured: tests/test_memory.py)."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def held_by(model: Any) -> dict[str, Any]:
    """What this process holds of `model`, counted on its tensors: `params` and `bytes` of the parameters
    as they sit here (a DTensor's local shard under FSDP), `of_params` the model's whole count, and the
    dtypes and devices found. A sharding that silently failed shows as params == of_params."""
    params = nbytes = whole = 0
    dtypes, devices = set(), set()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params += local.numel()
        nbytes += local.numel() * local.element_size()
        whole += p.numel()
        dtypes.add(dtype_name(local.dtype))
        devices.add(str(local.device))
    return {
        "params": params,
        "bytes": nbytes,
        "of_params": whole,
        "dtypes": sorted(dtypes),
        "devices": sorted(devices),
    }


def held_line(record: Mapping[str, Any]) -> str:
    """'rank 0 of 2 holds student 1,234 of 2,468 params (0.00 GB), teacher ...' from `held` records."""
    parts = [
        f"{role} {h['params']:,} of {h['of_params']:,} params ({h['bytes'] / GB:.2f} GB, "
        f"{'/'.join(h['dtypes'])} on {'/'.join(h['devices'])})"
        for role, h in record["models"].items()
    ]
    return f"rank {record['rank']} of {record['world_size']} holds " + ", ".join(parts)


def free_memory() -> None:
    """A garbage collection, then the CUDA cache given back to the device."""
    gc.collect()
    empty_cuda_cache()


def empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
