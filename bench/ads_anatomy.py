"""Why the completion gradient steers ADS where accuracy does not look, in the tiny world: the gradient of a
savegrad run taken apart by the kind of completion token it comes from, and a gradient without the tokens
where the teacher itself hesitates, saved so that 04 can steer by it.

    python -m bench.ads_anatomy --grads runs/antidistill/<run>/grads --out runs/grads-confident \
        [--compare runs/savegrad/<other run> ...]

For every completion token of the gradient's holdout traces it takes the teacher's entropy at that position
and whether the token belongs to the final answer (`Task.answer_start`), and splits the tokens into three
kinds: `answer`, `uncertain` (not the answer; teacher entropy above `--entropy`, 0.3 nats), `confident` (the
rest). With token normalisation the gradient is exactly the token-weighted sum of the kinds' own mean
gradients, so each kind's share of the squared norm (g_k · g / |g|^2, summing to 1) says what the gradient is
made of. `--compare` prints the cosine between this gradient and others (another holdout size, another
normalisation). The gradient of the `confident` and `answer` tokens together (the `uncertain` ones left out),
with the run's own normalisation, is saved in `--out` with the run's config.yaml and traces/, so that
`python -m opdkit.antidistill --set grads_run=<out>` steers by it.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from opdkit import tasks
from opdkit.ads import gradfile
from opdkit.ads.gradient import answer_labels, global_norm, mean_completion_grad
from opdkit.data import traces
from opdkit.data.labels import IGNORE
from opdkit.models import load_model, load_tokenizer
from opdkit.run.folders import RunDir


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    dot = sum(float((a[k].double() * b[k].double()).sum()) for k in a)
    return dot / (global_norm(a) * global_norm(b))


def token_kinds(teacher, tok, task, rows: list[dict], entropy: float) -> list[list[str | None]]:
    """Per row, per position: 'answer', 'uncertain', 'confident' for completion tokens (None elsewhere)."""
    out = []
    for t in rows:
        ids = torch.tensor([t["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(teacher(input_ids=ids).logits[0].float(), -1)
        ent = -(logp.exp() * logp).sum(-1)  # entropy of the prediction made at each position
        start = task.answer_start(t["messages"][-1]["content"])
        answer = answer_labels(tok, t["input_ids"], t["labels"], start) if start is not None else None
        kinds: list[str | None] = []
        for i, label in enumerate(t["labels"]):
            if label == IGNORE:
                kinds.append(None)
            elif answer is not None and answer[i] != IGNORE:
                kinds.append("answer")
            else:  # token i is predicted at position i - 1
                kinds.append("uncertain" if float(ent[i - 1]) > entropy else "confident")
        out.append(kinds)
    return out


def masked(rows: list[dict], kinds: list[list[str | None]], keep: set[str]) -> list[dict]:
    out = []
    for r, k in zip(rows, kinds):
        labels = [lab if kind in keep else IGNORE for lab, kind in zip(r["labels"], k)]
        if any(lab != IGNORE for lab in labels):
            out.append({"input_ids": r["input_ids"], "labels": labels})
    return out


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
    kinds = token_kinds(teacher, tok, task, rows, a.entropy)
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
        part, stats = mean_completion_grad(proxy, masked(rows, kinds, {kind}), "token", 8, pad)
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
            proxy, masked(rows, kinds, {"confident", "answer"}), meta.get("normalization", "trace"), 8, pad
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
            {**facts, **stats, "tokens": f"completion without teacher entropy > {a.entropy} nats"},
        )
        report["saved"] = str(a.out)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
