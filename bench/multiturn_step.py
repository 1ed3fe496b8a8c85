"""P10 and P10s (issues 38 and 48): a multi-turn optimizer step against a single-turn step at equal student
tokens: P10 its rollouts' time per sampled token, P10s the whole step's time per transcript token (the
student's and the tools').

    python -m bench.run --only P10,P10s --reps 5

Both sides are `DistillTrainer` steps (rollouts, the teacher's scoring, the loss, the backward, the optimizer)
on the tiny tool world's prompts (`tiny-tools`, templated with the calculator listed, so both sides read the
same prompts), the student `tiny:teacher-tools` (it calls the calculator, then copies its result) and the
teacher `tiny:teacher-tools`, at 05 tiny's shapes (32 prompts a step, 110 new tokens a turn), temperature 1,
forward KL (beta 0), float32, one process:

- `multi-turn`: episodes against the calculator (`rollout.multiturn.MultiTurnRollouts`, `max_turns` 2,
  `episode_max_tokens` 164) on the kit's loop, the KV cache kept between turns (`sampling.Turns`): the call,
  the tool's result rendered by the chat template (the second turn prefills only it), the answer; the loss on
  the student's two turns only, the teacher scoring the whole transcript;
- `single-turn`: the single-turn source (`rollout.source.EngineRollouts`) on the same prompts, its stop tokens
  replaced by one never sampled so every row samples exactly `single_turn_tokens` tokens, all of them in the
  loss: set to the multi-turn side's student tokens per row (measured, `student_tokens_per_row` in both
  sides' results) so both steps train on the same number of tokens, with no padding on this side.

After `warmup` steps, `steps` steps are timed (a callback at each step's end), in wall time and in the
process's CPU time (the figures: with one thread, what other jobs on a shared machine change least). Student
(sampled) tokens are the step's loss tokens (`DistillTrainer.stats.completion_tokens`); transcript tokens the
records' attended tokens after the prompts (single-turn: the student's alone). Phases per step, in wall
(`phase_s`) and CPU time (`phase_cpu_s`): `rollout` (the source's next_step), within it `engine` (the loop's
sample calls) and `template` (`MultiTurnRollouts.tool_ids`: the tool turns' chat-template rendering and
tokenizing), and `rest` (the teacher's and student's forwards, the loss, the backward and the optimizer). The
learning rate is tiny (1e-6) so the student, which starts equal to the teacher, keeps writing the same
episodes through the timed steps.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch

SIDES = ("multi-turn", "single-turn")
BASELINE = (
    "the single-turn step (EngineRollouts) of the same model on the same prompts, at equal student tokens"
)
MODEL = "tiny:teacher-tools"


def default_params(quick: bool = False) -> dict[str, Any]:
    """05 tiny's step (params/whitebox/tiny-tools.yaml: 32 prompts, 2 turns, 110 tokens a turn, 164 in all);
    `single_turn_tokens` 101: the multi-turn side's student tokens per row measured at these settings (96.0
    in the call, 5.3 in the answer, seeds 0: see bench/README.md); `quick`: a seconds-long smoke run."""
    shape = dict(
        max_turns=2, episode_max_tokens=164, max_new_tokens=110, max_prompt_length=96, lr=1e-6, seed=0
    )
    if quick:
        return dict(shape, batch=4, warmup=1, steps=1, single_turn_tokens=101)
    return dict(shape, batch=32, warmup=2, steps=12, single_turn_tokens=101)


class _Probe:
    """Seconds spent in the rollout source's next_step, the engine's sample calls and the tool turns'
    template, and the step's student (loss) and context (attended) tokens, read at each step's end."""

    def __init__(self, trainer):
        from opdkit.rollout import multiturn, sampling

        self.trainer = trainer
        self.seconds = {"rollout": 0.0, "engine": 0.0, "template": 0.0}
        self.cpu = dict.fromkeys(self.seconds, 0.0)
        self.tokens = self.context = self.prompt = self.rows = 0
        self.counts: dict[str, float] = {}
        self._patched: list[
            tuple[Any, str, Any]
        ] = []  # put back by close(): a test runs both sides in one process
        source = trainer.rollouts
        next_step = source.next_step

        def timed_next_step(student, batches, step):
            records = self._timed("rollout", next_step, student, batches, step)
            self.context += sum(int(r.attention_mask_BT.sum()) for r in records)
            self.prompt += sum(int(b["prompt_attention_mask"].sum()) for b in batches)
            self.rows += sum(r.input_ids_BT.shape[0] for r in records)
            for k, v in getattr(source, "counts", {}).items():
                self.counts[k] = self.counts.get(k, 0.0) + v
            return records

        source.next_step = timed_next_step
        self._patch(sampling, "sample", "engine")  # a single-turn call
        self._patch(sampling.Turns, "sample", "engine")  # a turn of the episodes, their cache kept
        self._patch(multiturn.MultiTurnRollouts, "tool_ids", "template")

    def _patch(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)
        self._patched.append((owner, name, fn))

        def timed(*args, **kwargs):
            return self._timed(phase, fn, *args, **kwargs)

        setattr(owner, name, timed)

    def close(self) -> None:
        for owner, name, fn in reversed(self._patched):
            setattr(owner, name, fn)

    def _timed(self, phase: str, fn, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[phase] += time.perf_counter() - t0
            self.cpu[phase] += time.process_time() - c0

    def snapshot(self) -> dict[str, Any]:
        self.tokens += int(self.trainer.stats.completion_tokens)  # this step's loss tokens
        return dict(
            t=time.perf_counter(),
            cpu=time.process_time(),
            tokens=self.tokens,
            context=self.context,
            prompt=self.prompt,
            rows=self.rows,
            seconds=dict(self.seconds),
            cpu_seconds=dict(self.cpu),
            counts=dict(self.counts),
        )


def _clock(probe: _Probe, warmup: int):
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks: dict[str, dict] = {}

        def on_step_end(self, args, state, control, **kwargs):
            now = probe.snapshot()
            if state.global_step == warmup:
                self.marks["start"] = now
            self.marks["end"] = now

    return Clock()


def _trainer(side: str, p: dict, out_dir: str):
    from transformers import AutoModelForCausalLM

    from opdkit import tiny
    from opdkit.models import load_tokenizer
    from opdkit.opd.arguments import OPDArguments
    from opdkit.opd.build import distill_trainer
    from opdkit.tasks.tinytools import TinyToolsTask

    multi = side == "multi-turn"
    tok = load_tokenizer(MODEL)
    prompts = TinyToolsTask().load_prompts(
        "tiny-tools", subset_size=p["batch"] * (p["warmup"] + p["steps"] + 1), seed=p["seed"]
    )
    args = OPDArguments(
        output_dir=out_dir,
        per_device_train_batch_size=p["batch"],
        max_steps=p["warmup"] + p["steps"],
        learning_rate=p["lr"],
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        beta=0.0,
        rollout_max_new_tokens=p["max_new_tokens"],
        environment="calculator" if multi else "",
        max_turns=p["max_turns"],
        episode_max_tokens=p["episode_max_tokens"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
        sample_every=0,
        seed=p["seed"],
    )
    cfg = SimpleNamespace(
        environment="calculator",  # both sides: the prompts templated with the calculator listed
        dataset_path="tiny-tools",
        max_prompt_length=p["max_prompt_length"],
        enable_thinking=False,
    )

    def load():
        return AutoModelForCausalLM.from_pretrained(tiny.resolve(MODEL), dtype=torch.float32)

    trainer = distill_trainer(cfg, args, load(), load().eval(), tok, prompts)
    if not multi:
        from opdkit.rollout.source import EngineRollouts

        src = trainer.rollouts
        settings = dataclasses.replace(
            src.settings, eos_token_ids=[len(tok) + 7], max_new_tokens=p["single_turn_tokens"]
        )  # a stop token never sampled: every row samples exactly single_turn_tokens tokens
        trainer.environment = None
        trainer.rollouts = EngineRollouts(
            src._make_engine, settings, src.seed, src.rank, src.world, src.batch_size
        )
    return trainer


def measure(side: str, p: dict) -> dict[str, Any]:
    """One side's warm-up and timed steps: seconds per step and per student token, and what is behind them."""
    from transformers.utils import logging as hf_logging

    if p["warmup"] < 1 or p["steps"] < 1:
        raise ValueError(f"warmup={p['warmup']} and steps={p['steps']} must both be >= 1")
    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _trainer(side, p, out_dir)
        probe = _Probe(trainer)
        clock = _clock(probe, p["warmup"])
        trainer.add_callback(clock)
        try:
            trainer.train()
        finally:
            probe.close()
            trainer.close_engine()
    a, b = clock.marks["start"], clock.marks["end"]
    n = p["steps"]
    wall, tokens, rows = b["t"] - a["t"], b["tokens"] - a["tokens"], b["rows"] - a["rows"]
    cpu = b["cpu"] - a["cpu"]
    transcript = (b["context"] - a["context"]) - (b["prompt"] - a["prompt"])
    phases = {k: (b["seconds"][k] - a["seconds"][k]) / n for k in a["seconds"]}
    phases["rest"] = wall / n - phases["rollout"]
    cpu_phases = {k: (b["cpu_seconds"][k] - a["cpu_seconds"][k]) / n for k in a["cpu_seconds"]}
    cpu_phases["rest"] = cpu / n - cpu_phases["rollout"]
    counts = {k: (b["counts"].get(k, 0.0) - a["counts"].get(k, 0.0)) / n for k in b["counts"]}
    return {
        "ms_per_token": 1000 * wall / tokens,
        # this process's CPU time (one thread): what other jobs on a shared machine change least
        "cpu_ms_per_token": 1000 * cpu / tokens,
        # the two figures: the rollouts per sampled token, the whole step per transcript token
        "rollout_cpu_ms_per_token": 1000 * cpu_phases["rollout"] * n / tokens,
        "cpu_ms_per_transcript_token": 1000 * cpu / transcript,
        "rollout_ms_per_token": 1000 * phases["rollout"] * n / tokens,
        "ms_per_transcript_token": 1000 * wall / transcript,
        "step_s": wall / n,
        "student_tokens_per_step": tokens / n,
        "student_tokens_per_row": tokens / rows,
        "transcript_tokens_per_row": transcript / rows,
        "context_tokens_per_row": (b["context"] - a["context"]) / rows,
        "phase_s": {k: round(v, 5) for k, v in phases.items()},
        "phase_cpu_s": {k: round(v, 5) for k, v in cpu_phases.items()},
        "episode_counts_per_step": counts,
        "load_average": os.getloadavg()[0],  # the machine is shared: the 1-minute load at the run's end
    }
