"""Why the completion gradient steers ADS where accuracy does not look, in the tiny world: the gradient of a
savegrad run taken apart by the kind of completion token it comes from, and a gradient without the tokens
where the teacher itself hesitates, saved so that 04 can steer by it.

    python -m bench.ads_anatomy --grads runs/antidistill/<run>/grads --out runs/grads-confident \
        [--compare runs/savegrad/<other run> ...]

For every completion token of the gradient's holdout traces it takes the teacher's entropy at that position
and whether the token belongs to the final answer (`Task.answer_start`), and splits the tokens into three
kinds (`opdkit.ads.tokenkinds`): `answer`, `uncertain` (not the answer; teacher entropy above `--entropy`, 0.3
nats), `confident` (the rest). With token normalisation the gradient is exactly the token-weighted sum of the
kinds' own mean gradients, so each kind's share of the squared norm (g_k · g / |g|^2, summing to 1) says what
the gradient is made of. `--compare` prints the cosine between this gradient and others (another holdout size,
another normalisation). The gradient of the `confident` and `answer` tokens together (the `uncertain` ones
left out), with the run's own normalisation, is saved in `--out` with the run's config.yaml and traces/, so
that `python -m opdkit.antidistill --set grads_run=<out> grad_tokens=confident` steers by it; savegrad
computes the same gradient itself with `--set grad_tokens=confident` (01/04's setting).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from opdkit import tasks
from opdkit.ads import gradfile
from opdkit.ads.gradient import global_norm, mean_completion_grad
from opdkit.ads.tokenkinds import GRAD_TOKENS, keep_kinds, teacher_entropies, token_kinds
from opdkit.data import traces
from opdkit.models import load_model, load_tokenizer
from opdkit.run.folders import RunDir


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    dot = sum(float((a[k].double() * b[k].double()).sum()) for k in a)
    return dot / (global_norm(a) * global_norm(b))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grads", type=Path, required=True, help="a savegrad run (grads.safetensors, traces/)")
    p.add_argument("--out", type=Path, help="where to save the gradient without the uncertain tokens")
    p.add_argument("--compare", type=Path, nargs="*", default=[], help="other savegrad runs of this proxy")
    p.add_argument("--entropy", type=float, default=0.3, help="nats: above it a token is 'uncertain'")
    a = p.parse_args(argv)
    config = RunDir.attach(a.grads).read_config()
    meta = gradfile.read_meta(a.grads)
    proxy, tok = (
        load_model(config["proxy_model"], torch.float32, "cpu"),
        load_tokenizer(config["proxy_model"]),
    )
    teacher = load_model(config["teacher_model"], torch.float32, "cpu").eval()
    task = tasks.for_dataset(config["dataset_path"])
    rows = list(traces.load_traces(a.grads))
    entropies = teacher_entropies(teacher, rows, 8, tok.pad_token_id)
    kinds = token_kinds(rows, entropies, tok, task.answer_start, a.entropy)
    g = gradfile.load_grads(a.grads, proxy, tok)
    report: dict = {"grads": str(a.grads), "normalization": meta.get("normalization"), "entropy": a.entropy}
    report["cosine"] = {str(o): cosine(g, gradfile.load_grads(o, proxy, tok)) for o in a.compare}
    # the token-normalised gradient is exactly the token-weighted sum of the kinds' token-normalised ones
    pad = tok.pad_token_id
    total, _ = mean_completion_grad(proxy, rows, "token", 8, pad)
    total = {k: v.clone() for k, v in total.items()}
    n_all = sum(1 for k in kinds for x in k if x)
    shares = {}
    for kind in ("confident", "uncertain", "answer"):
        part, stats = mean_completion_grad(proxy, keep_kinds(rows, kinds, frozenset({kind})), "token", 8, pad)
        weight = sum(1 for k in kinds for x in k if x == kind) / n_all
        dot = sum(float((weight * part[k].double() * total[k].double()).sum()) for k in total)
        shares[kind] = {
            "tokens": weight,
            "loss": weight * stats["loss"],
            "norm_share": dot / global_norm(total) ** 2,
            "cosine": cosine(part, total),
        }
    report["kinds"] = shares
    report["cosine_token_vs_saved"] = cosine(total, g)
    if a.out:
        keep, stats = mean_completion_grad(
            proxy,
            keep_kinds(rows, kinds, GRAD_TOKENS["confident"]),
            meta.get("normalization", "trace"),
            8,
            pad,
        )
        keep = {k: v.clone() for k, v in keep.items()}
        report["cosine_confident_vs_saved"] = cosine(keep, g)
        a.out.mkdir(parents=True, exist_ok=True)
        for name in ("config.yaml", "traces"):
            src, dst = a.grads / name, a.out / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
        facts = {
            k: v for k, v in meta.items() if k not in ("loss", "grad_norm", "tensor_norms", "tensor_shapes")
        }
        gradfile.save_grads(
            a.out,
            keep,
            {**facts, **stats, "grad_tokens": "confident", "grad_entropy": a.entropy},
        )
        report["saved"] = str(a.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
