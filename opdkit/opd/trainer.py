"""`DistillTrainer`: white-box on-policy distillation on transformers' `Trainer`.

One optimizer step:
1. `get_batch_samples` asks the rollout source for the step's prompt micro-batches and their rollouts
   (`rollout.source`; built from the settings by `rollout.build.rollout_source`: synchronous, sampled ahead
   in a producer process, or multi-turn episodes, each through the kit's loop or vLLM). Each record carries
   a per-token loss mask (1 on the tokens the student sampled); the teacher makes what it needs of each
   micro-batch and prepares the step (`teachers.base.Teacher`: e.g. a served teacher sends its requests),
   and the step's loss count (N: loss tokens, or what the teacher's divergence is a mean over) is summed
   across processes;
2. `compute_loss`, per micro-batch, asks the teacher for its side of the divergence at the positions the loss
   mask shifted by one marks (`RolloutRecord.predicting_BT`), then runs the teacher kind's student side as the
   wrapped student's forward (so DDP's and FSDP's hooks enclose it, `sharding.call_inside_forward`), with the
   positions the sampler used, and divides the summed divergence by N; so batch size x gradient accumulation
   x processes never changes the gradient. Where the source reports the sampler's log-probability of each
   sampled token (`sampling_logprobs_BT`), the same pass reads the student's, compared with it
   (`engine_logprob_gap`, checked in the first steps: `guards.SamplerChecks`) without a second forward, and
   for rollouts sampled ahead (`policy_version`) weighted by their importance ratio (`async_correction`);
3. `Trainer` clips (`max_grad_norm`) and steps; a non-finite gradient skips the step and ends the run
   with the last good weights (`guards`).

The trainer names no teacher kind and no rollout kind: it holds a `teachers.base.Teacher` (`teachers.of`
picks it) and a `rollout.source.RolloutSource`, and asks them. A `step` argument is the step's index, 0-based
(`global_step` when it starts); logs and messages number it from 1.

Step statistics stay on the device (no host read between forward and backward) until a logging step reads
them once (`metrics`), samples for samples.jsonl included (`samples`). The exception: the sampler checks of
the first steps (`guards.SamplerChecks`), one host read before the backward pass.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from opdkit.config import ConfigError
from opdkit.models import eos_ids, load_model
from opdkit.opd import teachers
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.guards import HeldRecord, NonFiniteStop, SamplerChecks, guarded_step
from opdkit.opd.metrics import Processes, StepStats, async_columns, step_columns
from opdkit.opd.samples import SampleKeeper
from opdkit.opd.teachers import served
from opdkit.opd.teachers.base import DivergenceInputs, Teacher, check_head_covers
from opdkit.rollout.build import rollout_source
from opdkit.rollout.source import RolloutRecord, RolloutSource
from opdkit.run import sharding
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir

TEACHER_SET_FILE = "teachers.json"  # a teacher's fingerprint (a set: each one's), compared at a resume


class DistillTrainer(Trainer):
    """White-box on-policy distillation on `Trainer`: `args` is an `OPDArguments`, `processing_class` the
    student's tokenizer, `teacher_model` the frozen teacher (a module, or a `teachers.base.Teacher`; its
    tokenizer, if given, is checked against the student's, and another one is read through
    `teachers.cross`); `run` receives metrics.jsonl, samples.jsonl and rollouts/; `rollouts` where the
    step's rollouts come from (default: the source the settings name, `rollout.build.rollout_source`; with
    `env`, an `opdkit.tasks` environment the caller built for the `environment` setting, episodes played
    against it). The teacher is used through its kind (`teachers.of`) only: what it needs before a step, what
    it gives the loss for a micro-batch, and the student's side of its divergence."""

    def __init__(
        self,
        *args,
        teacher_model: torch.nn.Module | Teacher,
        teacher_tokenizer: PreTrainedTokenizerBase | None = None,
        run: RunDir | None = None,
        rollouts: RolloutSource | None = None,
        env=None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, OPDArguments):
            raise TypeError(f"DistillTrainer needs args=OPDArguments(...), got {type(self.args).__name__}.")
        tok = self.processing_class
        if tok is None:
            raise ValueError("DistillTrainer needs the student's tokenizer as processing_class=...")
        self.teacher = teachers.of(teacher_model, tok, teacher_tokenizer, self.args)
        # The number of logits compared: the tokenizer's size (models may pad their vocabulary beyond it).
        check_head_covers("student", self.model, tok)
        self.vocab_size = len(tok)
        self.teacher.start(self.model, tok, self.args)
        # A completion ends at the tokenizer's EOS or any the student's generation config lists (Qwen3:
        # <|im_end|> and <|endoftext|>); what follows a stop token is never sampled into the loss.
        self.stop_ids = eos_ids(tok, self.model)
        self.teacher.place(self.args.device, shard=self.sharded)
        self.run = run
        self.model_accepts_loss_kwargs = True  # we normalise by num_items_in_batch ourselves
        self.stats = StepStats()
        self.last_grad_norm: float | None = None  # None: no step measured yet
        self.first_nonfinite_step: int | None = None
        a = self.args
        self.samples = SampleKeeper(a.sample_every, a.samples_per_log)  # kept where there is a run folder
        if a.async_correction != "none" and not self.teacher.importance_weighted:
            raise ConfigError(
                f"async_correction={a.async_correction} weights the exact divergence per token, and this "
                f"teacher's divergence ({type(self.teacher).__name__}) takes no weights: use "
                "async_correction none."
            )
        self.rollouts = rollouts or rollout_source(
            a,
            self.accelerator.unwrap_model(self.model),
            tok,
            self.stop_ids,
            sharded=self.sharded,
            env=env,
            enable_thinking=getattr(self.data_collator, "enable_thinking", False),
        )
        self.checks = SamplerChecks(a.world_size)
        self.add_callback(NonFiniteStop(self))
        self.add_callback(HeldRecord(self))

    @property
    def sharded(self) -> bool:
        """The student is sharded over processes (FSDP with several): its forward is a collective."""
        return self.is_fsdp_enabled and self.args.world_size > 1

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        plugin_args = self.args.fsdp_plugin_args
        if plugin_args and sharding.treat_cpu_processes_as_fsdp(self.accelerator, plugin_args):
            self.is_fsdp_enabled = True
        if self.is_fsdp_enabled:
            sharding.keep_fp32_outputs(self.accelerator.state.fsdp_plugin)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's prompt micro-batches, sampled (`rollouts.prompts`, `rollouts.next_step`), each with the
        teacher's own inputs of it (`Teacher.inputs`), the teacher prepared for the step, and the step's loss
        count across processes (N: loss tokens, or what the teacher's divergence is a mean over)."""
        step = self.state.global_step
        batches = self.rollouts.prompts(epoch_iterator, num_batches, step)
        self.rollouts.open()  # an engine built (vLLM: tens of seconds) before the step's clock starts
        self.stats = StepStats(teacher_sums=self.teacher.new_sums(device))
        student = self.accelerator.unwrap_model(self.model)
        records = self.rollouts.next_step(student, batches, step) if batches else []
        versions = [r.policy_version for r in records if r.policy_version is not None]
        if versions:
            self.stats.staleness = step - min(versions)
        self.checks.start_step(records)
        inputs = []
        for record in records:
            self.stats.add_rollouts(record)
            inputs.append(self.micro_batch(record))
        if inputs:  # e.g. a served teacher: the step's rows sent now
            self.teacher.prepare([(s["record"], s["teacher_inputs"]) for s in inputs], step)
        if self.args.save_rollouts and self.run:
            self._save_rollouts(inputs, step)
        n_local = sum(
            (self.teacher.loss_count(s["record"], s["teacher_inputs"]) for s in inputs),
            torch.zeros((), device=device),
        ).float()
        n_global = self.accelerator.reduce(n_local, reduction="sum") if self.args.world_size > 1 else n_local
        return inputs, n_global.clamp(min=1.0)

    def engine(self):
        """The rollout engine of a synchronous source, built at the first use (a job evaluates through it)."""
        return self.rollouts.engine()

    def trained_model(self, saved: str | Path) -> PreTrainedModel:
        """The student to evaluate after training, without accelerate's autocast wrapper (evaluation applies
        the run's one precision itself). A sharded one is replaced by the saved full model (`saved`, written
        by `save_model`) on every rank: each rank generates for its own share of prompts, so sharded layers,
        whose every forward is a collective, would wait on ranks that have stopped."""
        if not self.is_fsdp_enabled:
            return self.accelerator.unwrap_model(self.model, keep_fp32_wrapper=False)
        self.accelerator.wait_for_everyone()  # rank 0 has written the saved model
        return load_model(str(saved), torch.float32, self.args.device)

    def close_engine(self) -> None:
        """Shut the rollout source down when the run is over (a vLLM engine gives its memory back; see
        a vLLM engine's `close`); the job calls it however the run ends."""
        self.rollouts.close()

    def micro_batch(self, record: RolloutRecord) -> dict:
        """What `compute_loss` takes for a record: the record, the teacher's own inputs of it
        (`Teacher.inputs`), and its `input_ids` (transformers' `Trainer` counts a step's tokens from them)."""
        return {
            "input_ids": record.input_ids_BT,
            "record": record,
            "teacher_inputs": self.teacher.inputs(record),
        }

    def _save_rollouts(self, inputs: list[dict], step: int) -> None:
        folder = self.run.path / "rollouts"
        folder.mkdir(exist_ok=True)
        keep = []
        for s in inputs:
            tensors = {**s["record"].tensors(), **self.teacher.saved(s["teacher_inputs"])}
            keep.append({k: v.cpu() for k, v in tensors.items()})
        torch.save(keep, folder / f"step{step + 1:06d}-rank{self.args.process_index}.pt")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        record, own = inputs["record"], inputs["teacher_inputs"]
        ids_BT, attn_BT, step = record.input_ids_BT, record.attention_mask_BT, self.state.global_step
        pred_BT = record.predicting_BT()  # the loss mask shifted by one: the state at t predicts token t+1
        fwd = dict(
            input_ids=ids_BT, attention_mask=attn_BT, position_ids=record.position_ids_BT(), use_cache=False
        )
        part = self.teacher.score(record, own, fwd, pred_BT)
        target_N = sampling_logprobs_N = None
        if record.sampling_logprobs_BT is not None:
            # Selected here, where the scoring above has already waited for the device, not after the
            # student's forward: the sampled token each predicting position was followed by, and the
            # sampler's log-probability of it (both in the loss mask's order).
            target_N = ids_BT[:, 1:][pred_BT[:, :-1]]
            sampling_logprobs_N = record.sampling_logprobs_BT[record.loss_mask_BT.bool()]
        student = self.accelerator.unwrap_model(model)
        stale = record.policy_version is not None and sampling_logprobs_N is not None
        if stale and self.checks.sampler_gap_now:
            gap = self.checks.sampler_gap(
                student, self.rollouts, record, fwd, pred_BT, target_N, sampling_logprobs_N, self.args, step
            )
            if gap is not None:
                self.stats.sampler_gap = gap
        correct = stale and self.args.async_correction == "truncated"
        given = DivergenceInputs(
            beta=self.args.beta,
            temperature=self.args.kl_temperature,
            vocab_size=self.vocab_size,
            chunk_size=self.args.loss_chunk_size,
            target_ids_N=target_N,
            sampling_logprobs_N=sampling_logprobs_N if correct else None,
            ratio_cap=self.args.async_ratio_cap,
        )

        def student_part(**fwd):
            return self.teacher.student_divergence(student, fwd, pred_BT, part, given)

        # The model's own forward runs under accelerate's autocast (bf16); the redirected one must too.
        with self.accelerator.autocast():
            parts = sharding.call_inside_forward(model, student, student_part, **fwd)
        out, sums = self.teacher.output(parts, record, part)
        if num_items_in_batch is not None:
            n = num_items_in_batch
        else:  # the micro-batch's own loss count
            n = self.teacher.loss_count(record, own).clamp(min=1)
        # DDP and FSDP average gradients over processes, so each process's share is scaled back up.
        loss = out.sum / n * self.args.world_size
        self.stats.entropy_sum += out.student_entropy_N.sum()
        if sampling_logprobs_N is not None:
            log_ratio_N = out.student_token_logprob_N - sampling_logprobs_N.to(out.student_token_logprob_N)
            self.stats.add_gap(log_ratio_N.abs())
            self.checks.after_loss(log_ratio_N.abs(), self.rollouts, step)
            if stale:
                self.stats.add_ratios(log_ratio_N, self.args.async_ratio_cap)
        if sums is not None:
            self.stats.add_teacher_sums(sums)
        if self.run:
            self.samples.keep(record, pred_BT, out.per_token_N, step)
        return (loss, out) if return_outputs else loss

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, the teacher's fingerprint first (where its kind has one): saved beside the
        checkpoints (`TEACHER_SET_FILE`) when the run starts, compared when it resumes (another teacher: one
        line, before any step); the rollout source resumed from the checkpoint (`RolloutSource.load`: e.g.
        the steps sampled ahead that it had queued, regenerated by the weights that sampled them)."""
        self._check_fingerprint(resume_from_checkpoint)
        last = resume_from_checkpoint
        if last is True:
            last = get_last_checkpoint(self.args.output_dir)
        if last:
            self.rollouts.load(Path(last))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        """`Trainer._save_checkpoint`, the rollout source's state first (`RolloutSource.save`, rank 0): before
        transformers' files, whose `trainer_state.json` comes last, so a checkpoint complete by that file has
        it; inside the folder, so `save_total_limit` rotates it with the checkpoint."""
        if self.args.process_index == 0:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            self.rollouts.save(Path(self._get_output_dir(trial=trial)) / name)
        super()._save_checkpoint(model, trial)

    def _check_fingerprint(self, resume_from_checkpoint) -> None:
        probe = self.processing_class(served.PROBE_TEXT, add_special_tokens=False)["input_ids"]
        now = self.teacher.fingerprint(probe)
        if now is None:
            return
        path = Path(self.args.output_dir) / TEACHER_SET_FILE
        if resume_from_checkpoint and path.exists():
            self.teacher.check_same(json.loads(path.read_text()), now)
        elif self.args.process_index == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(now, indent=1))

    def _get_grad_norm(self, model, grad_norm=None):
        # Under FSDP2 the norm of sharded gradients is a DTensor; every rank gathers its value.
        grad_norm = sharding.full_tensor(super()._get_grad_norm(model, grad_norm))
        value = float(grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm)
        self.last_grad_norm = value
        if not math.isfinite(value) and self.first_nonfinite_step is None:
            self.first_nonfinite_step = self.state.global_step + 1
        return grad_norm

    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model)
        opt.step = guarded_step(self, opt)  # a non-finite gradient never reaches the weights
        return opt

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs and "grad_norm" in logs:
            logs.update(self._step_metrics(logs))
        elif "eval_accuracy" in logs and self.run and self.args.process_index == 0:
            evals = {k: v for k, v in logs.items() if k.startswith("eval_")}  # eval_tool_call_share too
            self.run.log({"step": self.state.global_step, **evals})
        super().log(logs, start_time)

    def _step_metrics(self, logs: dict) -> dict:
        """The step's metrics.jsonl row (`metrics`: the trainer's columns; the teacher kind's; with rollouts
        sampled ahead their staleness and ratios; the source's own), and its samples to samples.jsonl."""
        a = self.args
        procs = Processes(a.device, a.world_size)
        row, teacher_sums = step_columns(
            self.stats, logs, self.state.global_step, a.max_grad_norm, self.teacher.gives_entropy, procs
        )
        # The kind's own: each teacher's divergence of a set, a served teacher's gap to its reference, the
        # label of an approximate divergence beside the loss.
        row.update(self.teacher.metrics(teacher_sums))
        if self.rollouts.ahead:
            row.update(async_columns(self.stats, procs))
        row.update(self.rollouts.step_metrics(procs.sum))
        if self.run and a.process_index == 0:
            self.run.log(row)
            for sample in self.samples.rows(self.processing_class):
                self.run.log(sample, "samples.jsonl")
        self.samples.clear()
        return {k: v for k, v in row.items() if k not in ("step", "loss", "grad_norm")}
