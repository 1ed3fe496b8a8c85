"""ADS sampling: the teacher's next-token logits plus λ·Δ, then temperature, top-k and top-p, token by token
(`ads_sample`, through `ADSLogitsProcessor`); and `coupled_sample`, ADS and plain sampling drawn with the same
noise (Gumbel-max), so that where the two draws differ the ADS term moved the draw (what `TokenLens` shows).

    r = ads_sample(teacher, prompt_ids_BP, prompt_mask_BP, direction=direction, lam=0.1,
                   temperature=1.0, top_p=0.95, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id, max_new_tokens=40)          # a sampling.Rollout
    texts = sample_traces(teacher, tok, messages, direction=direction, lam=0.1, temperature=1.0, seed=0)
    steps = coupled_sample(teacher, direction, prompt_ids, lam=0.1, temperature=1.0, ...)

The order of operations is the reference's: λΔ is added to the *raw* teacher logits, then temperature, then
top-k and top-p. `ads_sample` puts temperature and top-p into its own processor list, after the ADS term, and
calls `sampling.sample` with temperature 1 and top-p 1, which applies the list in order and nothing else (no
top-k, nothing from the checkpoint's generation config). The paper's Algorithm 1 divides λΔ by τ with the
teacher's logits, so its λ is this kit's λ/τ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerBase

from opdkit import memory
from opdkit.ads.direction import CachedLM, Direction
from opdkit.data import prompts
from opdkit.models import eos_ids
from opdkit.rollout import sampling

if TYPE_CHECKING:
    from transformers import PreTrainedModel  # annotations only: its module takes seconds to import


class ADSLogitsProcessor(LogitsProcessor):
    """Adds λ·Δ to the teacher's raw next-token logits; one instance per sampled batch.

    `prompt_mask_BP` is the attention mask of the left-padded prompts that sampling starts from. The
    first call runs the proxies on the whole prompt; each later call on the newest token only. With
    λ = 0 the scores pass through untouched (and the proxies are never run).
    """

    def __init__(self, direction: Direction, lam: float, prompt_mask_BP: torch.Tensor):
        self.direction, self.lam, self.prompt_mask_BP = direction, float(lam), prompt_mask_BP
        self.seen: int | None = None
        self.last_delta_BV: torch.Tensor | None = None

    def delta(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        t = input_ids_BT.shape[1]
        if t == self.prompt_mask_BP.shape[1]:
            d = self.direction.start(input_ids_BT, self.prompt_mask_BP.to(input_ids_BT.device))
        elif self.seen is not None and t == self.seen + 1:
            d = self.direction.step(input_ids_BT[:, -1:])
        else:
            raise RuntimeError(
                f"ADSLogitsProcessor got {t} tokens after {self.seen}; it follows one sampled batch token by "
                "token, so make a new processor for each batch."
            )
        self.seen = t
        return d

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.lam == 0.0:
            return scores
        d = self.delta(input_ids)
        self.last_delta_BV = d
        v = min(scores.shape[-1], d.shape[-1])
        out = scores.float().clone()
        out[:, :v] += self.lam * d[:, :v].to(out.device)
        return out


def ads_processors(
    direction: Direction | None,
    lam: float,
    prompt_mask_BP: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int = 0,
) -> LogitsProcessorList:
    """ADS term, then temperature, top-k and top-p (no warpers when greedy): the whole chain `ads_sample`
    uses, in the order of transformers' `generate` with a custom logits processor (the ADS reference's)."""
    if lam != 0 and direction is None:
        raise ValueError(
            f"lam={lam} needs a direction (FiniteDifference or JVP); only lam=0 samples without one."
        )
    procs = LogitsProcessorList()
    if lam != 0:
        procs.append(ADSLogitsProcessor(direction, lam, prompt_mask_BP))
    if temperature > 0:
        procs.extend(sampling.warpers(temperature, top_p, top_k))
    return procs


def ads_sample(
    teacher: PreTrainedModel,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    *,
    direction: Direction | None,
    lam: float,
    temperature: float,
    top_p: float,
    eos_token_id: int | list[int],
    pad_token_id: int,
    max_new_tokens: int,
    top_k: int = 0,
) -> sampling.Rollout:
    """Sample the teacher with ADS (λ·Δ, then temperature, then top-p); temperature 0 is greedy on z + λΔ.

    λ = 0 gives exactly `sampling.sample(teacher, ..., temperature=temperature, top_p=top_p)`: the same
    processors in the same order, so the same tokens for the same seed. `direction` may be None only then.
    """
    procs = ads_processors(direction, lam, prompt_mask_BP, temperature, top_p, top_k)
    return sampling.sample(
        teacher,
        prompt_ids_BP,
        prompt_mask_BP,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        do_sample=temperature > 0,
        logits_processor=procs,
    )


def sample_traces(
    teacher: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    messages: list[list[dict]],
    *,
    direction: Direction | None,
    lam: float,
    temperature: float,
    seed: int,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 512,
    batch_size: int = 64,
    enable_thinking: bool = False,
    desc: str = "traces",
) -> list[tuple[str, bool]]:
    """The teacher's answer to every prompt conversation by `ads_sample`, as (completion text, truncated), in
    the prompts' order. Prompts of similar length share a batch; the noise is seeded once by `seed`, so two
    calls that differ only by λ and τ draw with the same stream."""
    eos = eos_ids(tok, teacher)
    dev = next(teacher.parameters()).device
    ids = [prompts.prompt_ids(tok, m, enable_thinking) for m in messages]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))  # similar lengths share a batch
    torch.manual_seed(seed)
    out: dict[int, tuple[str, bool]] = {}
    for s in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
        batch = order[s : s + batch_size]
        prompts_BP, mask_BP = sampling.left_pad([ids[i] for i in batch], tok.pad_token_id, dev)
        r = ads_sample(
            teacher,
            prompts_BP,
            mask_BP,
            direction=direction,
            lam=lam,
            temperature=temperature,
            top_p=top_p,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
        )
        done = ~r.truncated_B(eos)
        for b, (i, text) in enumerate(zip(batch, sampling.decode_completions(tok, r))):
            out[i] = (text, not bool(done[b]))
    return [out[i] for i in range(len(ids))]


def warp(logits_V: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """The same temperature, top-k and top-p as `ads_sample` (none when greedy), on one row of logits."""
    out = logits_V[None].float()
    if temperature > 0:
        for w in sampling.warpers(temperature, top_p, top_k):
            out = w(None, out)
    return out[0]


@torch.no_grad()
def coupled_sample(
    teacher: PreTrainedModel,
    direction: Direction | None,
    prompt_ids: list[int],
    *,
    lam: float,
    temperature: float,
    top_p: float,
    eos_token_id: int | list[int],
    max_new_tokens: int,
    seed: int = 0,
    top_k: int = 0,
) -> list[dict]:
    """One ADS completion, and at every step the token plain sampling would have drawn with the same noise.

    Both distributions are sampled by Gumbel-max with one shared noise draw per step, so a step differs only
    where ADS moved the argmax; the trace continues with the ADS token. Returns per step: `token`,
    `plain_token`, `p_ads` (ADS probability of `token`), `p_plain` (plain probability of `token`),
    `p_plain_choice` (plain probability of `plain_token`). λ = 0 gives plain sampling itself.
    """
    dev = next(teacher.parameters()).device
    ids_1P = torch.tensor([prompt_ids], device=dev)
    mask_1P = torch.ones_like(ids_1P)
    eos = set(torch.as_tensor(eos_token_id).reshape(-1).tolist())
    lm = CachedLM(teacher)
    z_V = lm.start(ids_1P, mask_1P)[0]
    d_V = direction.start(ids_1P, mask_1P)[0] if lam else None
    gen = torch.Generator().manual_seed(seed)
    steps: list[dict] = []
    for _ in range(max_new_tokens):
        plain_V = warp(z_V, temperature, top_p, top_k)
        ads_V = z_V.clone()
        if d_V is not None:
            v = min(len(ads_V), len(d_V))
            ads_V[:v] += lam * d_V[:v].to(ads_V.device)
        ads_V = warp(ads_V, temperature, top_p, top_k)
        noise_V = _gumbel(len(z_V), gen).to(dev) if temperature > 0 else torch.zeros_like(z_V)
        a, b = int((ads_V + noise_V).argmax()), int((plain_V + noise_V).argmax())
        p_ads, p_plain = ads_V.softmax(-1), plain_V.softmax(-1)
        steps.append(
            {
                "token": a,
                "plain_token": b,
                "p_ads": float(p_ads[a]),
                "p_plain": float(p_plain[a]),
                "p_plain_choice": float(p_plain[b]),
            }
        )
        if a in eos:
            break
        new_11 = torch.tensor([[a]], device=dev)
        z_V = lm.step(new_11)[0]
        d_V = direction.step(new_11)[0] if d_V is not None else None
    return steps


def _gumbel(n: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(u))).float()


def sampling_stage(cfg: Any, budget: float | None, gradients: int = 1) -> memory.Stage:
    """What one process holds while the teacher samples `trace_batch_size` traces steered by the proxy's
    perturbed copies, for the memory plan: the teacher (bf16 on a GPU when `bf16`), the proxy with its
    `gradients` (in host memory on a GPU) and, for fd, its two perturbed fp32 copies, each with its KV
    cache."""
    gpu = budget is not None
    return memory.Stage(
        teacher=memory.ModelShape.from_config(cfg.teacher_model),
        proxy=memory.ModelShape.from_config(cfg.proxy_model),
        teacher_dtype="bfloat16" if cfg.bf16 and gpu else "float32",
        proxy_dtype="float32",
        bf16=False,
        device="cuda" if gpu else "cpu",
        sampler="teacher",
        sampled_rows=cfg.trace_batch_size,
        prompt_len=cfg.max_prompt_length,
        completion_len=cfg.trace_max_new_tokens,
        ads_copies=2 if cfg.ads_method == "fd" else 0,
        proxy_gradients=gradients,
        proxy_on_host=gpu,
    )
