"""ADS and plain sampling drawn with the same noise (Gumbel-max), token by token: where the two draws differ,
the ADS term moved the draw. What `TokenLens` shows.

    steps = coupled_sample(teacher, direction, prompt_ids, lam=0.1, temperature=1.0, ...)
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from opdkit.ads import Direction, _CachedLM, _warp


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
    lm = _CachedLM(teacher)
    z_V = lm.start(ids_1P, mask_1P)[0]
    d_V = direction.start(ids_1P, mask_1P)[0] if lam else None
    gen = torch.Generator().manual_seed(seed)
    steps: list[dict] = []
    for _ in range(max_new_tokens):
        plain_V = _warp(z_V, temperature, top_p, top_k)
        ads_V = z_V.clone()
        if d_V is not None:
            v = min(len(ads_V), len(d_V))
            ads_V[:v] += lam * d_V[:v].to(ads_V.device)
        ads_V = _warp(ads_V, temperature, top_p, top_k)
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
