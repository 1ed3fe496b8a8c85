"""P9: how far `teacher_logprobs: topk:K` (`opd.teachers.topk`, the teacher's top-K log-probabilities plus one
tail bin) is from the exact divergence, on the tiny world: the divergence's and the student gradient's
relative error against exact for K in `KS` (V = 101).

    python -m bench.run --only P9 --reps 1      # ~1 min; the numbers do not vary between runs (seeded)

The batch is what OPD trains on: the tiny student's own completions (temperature 1, seeded) of tiny-task
prompts, scored by the tiny teacher at every completion position, reverse KL (beta 1, the trainer's
default). The teacher's top-K is `topk.teacher_topk` of its logits in this process, laid out as vLLM's
prompt_logprobs are (tests/test_opd_teachers_served_vllm.py checks a real server's against it to 1e-4), so no
server runs. The gradient is that of the summed divergence with respect to every student parameter;
`gradient_error` is |g_K - g| / |g| and `gradient_cosine` cos(g_K, g). The figure's value is the share of
the exact divergence the top-20 divergence keeps (the top-K divergence never exceeds the exact one).
"""

from __future__ import annotations

from typing import Any

SIDES = ("topk20", "exact")
KS = (1, 5, 20, 100)
BASELINE = "the exact divergence (every logit: teacher_logprobs exact)"


def default_params(quick: bool = False) -> dict[str, Any]:
    return {"prompts": 4 if quick else 32, "seed": 0, "beta": 1.0, "k": 20}


def errors(p: dict) -> dict[str, Any]:
    """The exact summed divergence, and per K the top-K one with its errors (divergence, gradient)."""
    import torch
    from transformers import AutoModelForCausalLM

    from opdkit import tiny
    from opdkit.data.prompts import PromptCollator
    from opdkit.models import load_tokenizer
    from opdkit.opd.loss import per_token_divergence
    from opdkit.opd.teachers import topk
    from opdkit.rollout import sampling
    from opdkit.tasks import tiny as task

    tok = load_tokenizer("tiny:student")
    student = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:student")).eval()
    teacher = AutoModelForCausalLM.from_pretrained(tiny.resolve("tiny:teacher")).eval()
    problems = task.problems(p["prompts"], p["seed"])
    rows = [{"messages": [{"role": "user", "content": q.prompt}]} for q in problems]
    batch = PromptCollator(tok, 64)(rows)
    torch.manual_seed(p["seed"])
    r = sampling.sample(
        student,
        batch["prompts"],
        batch["prompt_attention_mask"],
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_new_tokens=task.MAX_COMPLETION_TOKENS,
    )
    P, comp_BC = r.prompt_len, r.completion_mask_BC.bool()
    fwd = dict(input_ids=r.input_ids_BT, attention_mask=r.attention_mask_BT, position_ids=r.position_ids_BT)
    vocab = len(tok)
    with torch.no_grad():
        t_NV = teacher(**fwd).logits[:, P - 1 : -1][comp_BC][:, :vocab]
    actual_N = r.input_ids_BT[:, P:][comp_BC]
    params = [q for q in student.parameters() if q.requires_grad]

    def loss_and_grad(divergence):
        s_NV = student(**fwd).logits[:, P - 1 : -1][comp_BC][:, :vocab]
        d = divergence(s_NV).sum()
        g = torch.autograd.grad(d, params, allow_unused=True)
        flat = [(x if x is not None else torch.zeros_like(q)).flatten() for x, q in zip(g, params)]
        return float(d.detach()), torch.cat(flat)

    exact, g = loss_and_grad(lambda s_NV: per_token_divergence(s_NV, t_NV, beta=p["beta"]))
    out = {"exact": exact, "tokens": int(comp_BC.sum()), "vocab": vocab, "by_k": {}}
    for k in KS:
        ids_NK, logp_NK = topk.teacher_topk(t_NV, k, actual_N)
        d_k, g_k = loss_and_grad(
            lambda s_NV, i=ids_NK, lp=logp_NK: topk.topk_divergence(s_NV, i, lp, beta=p["beta"])
        )
        out["by_k"][str(k)] = {
            "divergence": d_k,
            "divergence_error": (exact - d_k) / exact,
            "gradient_error": float((g_k - g).norm() / g.norm()),
            "gradient_cosine": float(g_k @ g / (g_k.norm() * g.norm())),
        }
    return out


def measure(side: str, p: dict) -> dict[str, Any]:
    found = errors(p)
    kept = found["by_k"][str(p["k"])]["divergence"] if side == "topk20" else found["exact"]
    return {"divergence": kept, **found}
