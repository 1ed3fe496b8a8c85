"""`DistillTrainer`: white-box on-policy distillation on transformers' `Trainer`.

One optimizer step:
1. `get_batch_samples` pulls the step's prompt micro-batches and asks the rollout source for their rollouts
   (`rollout.source`; by default `EngineRollouts`: the kit's KV-cached loop, or vLLM colocated in this
   process with the student's weights synced first, sampling every prompt of the step in one call, the rows
   regrouped by length into micro-batches each trimmed to its own longest row). Each record carries a
   per-token loss mask (1 on the tokens the student sampled); the teacher makes what it needs of each
   micro-batch and prepares the step (`teachers.base.Teacher`: e.g. a served teacher sends its requests),
   and the step's loss count (N: loss tokens, or what the teacher's divergence is a mean over) is summed
   across processes;
2. `compute_loss`, per micro-batch, asks the teacher for its side of the divergence at the positions the loss
   mask shifted by one marks (`RolloutRecord.predicting_BT`), then runs the teacher kind's student side as the
   wrapped student's forward (so DDP's and FSDP's hooks enclose it, `sharding.call_inside_forward`), with the
   positions the sampler used, and divides the summed divergence by N; so batch size x gradient accumulation
   x processes never changes the gradient. With vLLM the same pass reads the student's log-probability of
   each sampled token, compared with the engine's (`engine_logprob_gap`) without a second forward;
3. `Trainer` clips (`max_grad_norm`) and steps; a non-finite gradient skips the step and ends the run
   with the last good weights.

The trainer names no teacher kind: it holds a `teachers.base.Teacher` (`teachers.of` picks it) and asks it.

Step statistics stay on the device (no host read between forward and backward) until a logging step
reads them once, samples for samples.jsonl included (the rows sampled first, whatever micro-batch their
length put them in). The exception: with vLLM the first micro-batch of each
of the first `SYNC_CHECK_STEPS` steps reads its gap and stops the run (`engines.WeightSyncError`) before the
backward pass if the engine's log-probabilities differ from the student's by more than rounding. In a fresh
run the engine loaded the first step's weights from the student's own folder, so a wrong sync first shows
at the second step (after a resume, at the first). Rollouts sampled ahead (`rollout_ahead`) come from older
weights: the same check reads instead their gap to the weights that sampled them (`_sampler_gap`, one extra
forward on each step's first micro-batch, logged as `async/sampler_logprob_gap`).
"""

from __future__ import annotations

import functools
import json
import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from opdkit import memory
from opdkit.config import ConfigError
from opdkit.models import eos_ids, load_model
from opdkit.opd import teachers
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.teachers import served
from opdkit.opd.teachers.base import DivergenceInputs, Teacher, check_head_covers
from opdkit.rollout import engines, sampling
from opdkit.rollout.ahead import AheadRollouts, PromptLookahead, load_queued, logprobs_under, save_queued
from opdkit.rollout.multiturn import MultiTurnRollouts
from opdkit.rollout.source import EngineRollouts, RolloutRecord, RolloutSource
from opdkit.run import sharding
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir
from opdkit.settings import OPDSettings

SYNC_CHECK_STEPS = 2
TEACHER_SET_FILE = "teachers.json"  # a teacher's fingerprint (a set: each one's), compared at a resume


Number = float | torch.Tensor


@dataclass
class StepStats:
    """Per-step sums, device tensors where they come from the step's tensors (read when logged, reduced
    across processes then)."""

    sequences: Number = 0.0
    completion_tokens: Number = 0.0  # loss tokens: the tokens the student sampled
    truncated: Number = 0.0
    entropy_sum: Number = 0.0
    gap_sum: Number = 0.0  # sum of |log p_engine - log p_student| over the sampled tokens (vllm)
    gap_tokens: Number = 0.0
    teacher_sums: torch.Tensor | None = None  # the teacher kind's own (`Teacher.new_sums`)
    started: float = field(default_factory=time.time)
    # Rollouts sampled ahead: the step's staleness, and its importance ratios' sum, count, capped count
    # and maximum over this process's loss tokens.
    staleness: int | None = None
    ratios: torch.Tensor | None = None
    # Its first micro-batch's |log p_engine - log p_version| summed, and its token count: against the weights
    # that sampled it (`DistillTrainer._sampler_gap`).
    sampler_gap: torch.Tensor | None = None

    def add_ratios(self, log_ratio_N: torch.Tensor, cap: float) -> None:
        ratio_N = log_ratio_N.detach().double().exp()
        now = torch.stack(
            [ratio_N.sum(), ratio_N.new_tensor(float(ratio_N.numel())), (ratio_N > cap).sum().double()]
        )
        top = ratio_N.max() if ratio_N.numel() else ratio_N.new_zeros(())
        if self.ratios is None:
            self.ratios = torch.cat([now, top[None]])
        else:
            self.ratios = torch.cat([self.ratios[:3] + now, torch.maximum(self.ratios[3], top)[None]])

    def as_tensor(self, device) -> torch.Tensor:
        vals = [
            self.sequences,
            self.completion_tokens,
            self.truncated,
            self.entropy_sum,
            self.gap_sum,
            self.gap_tokens,
        ]
        out = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in vals])
        if self.teacher_sums is None:
            return out
        return torch.cat([out, self.teacher_sums.to(device, torch.float64)])


class DistillTrainer(Trainer):
    """White-box on-policy distillation on `Trainer`: `args` is an `OPDArguments`, `processing_class` the
    student's tokenizer, `teacher_model` the frozen teacher (a module, or a `teachers.base.Teacher`; its
    tokenizer, if given, is checked against the student's, and another one is read through
    `teachers.cross`); `run` receives metrics.jsonl, samples.jsonl and rollouts/; `rollouts` where the
    step's rollouts come from (default: `EngineRollouts` through `rollout_engine`; with `environment`, an
    `opdkit.tasks` environment the caller built, `multiturn.MultiTurnRollouts` playing episodes against it).
    The teacher is used through its kind (`teachers.of`) only: what it needs before a step, what it gives the
    loss for a micro-batch, and the student's side of its divergence."""

    def __init__(
        self,
        *args,
        teacher_model: torch.nn.Module | Teacher,
        teacher_tokenizer: PreTrainedTokenizerBase | None = None,
        run: RunDir | None = None,
        rollouts: RolloutSource | None = None,
        environment=None,
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
        self.teacher.place(self.args.device, shard=self.is_fsdp_enabled and self.args.world_size > 1)
        self.run = run
        self.model_accepts_loss_kwargs = True  # we normalise by num_items_in_batch ourselves
        self.stats = StepStats()
        self.last_grad_norm: float | None = None  # None: no step measured yet
        self.first_nonfinite_step: int | None = None
        self._step_samples: list[dict] = []  # tensors until a logging step writes them
        self._check_async()
        self.environment = environment
        self.rollouts = rollouts or self._engine_rollouts()
        self._lookahead = PromptLookahead(self.rollouts.ahead)
        self._sync_checks_left = SYNC_CHECK_STEPS
        self._check_sync_now = False  # set per step: the step's first micro-batch checks the gap
        self._sampler_checks_left = SYNC_CHECK_STEPS
        self._sampler_gap_now = False  # set per step: the step's first micro-batch measures the sampler gap
        self._check_sampler_now = False  # and checks it (the first steps sampled ahead)
        self.add_callback(_NonFiniteStop(self))
        self.add_callback(_HeldRecord(self))

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        plugin_args = self.args.fsdp_plugin_args
        if plugin_args and sharding.treat_cpu_processes_as_fsdp(self.accelerator, plugin_args):
            self.is_fsdp_enabled = True
        if self.is_fsdp_enabled:
            sharding.keep_fp32_outputs(self.accelerator.state.fsdp_plugin)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The step's prompt micro-batches, sampled (`rollouts.next_step`), each with what the teacher makes
        of it (`Teacher.inputs`), the teacher prepared for the step, and the step's loss count across
        processes (N: loss tokens, or what the teacher's divergence is a mean over)."""
        step = self.state.global_step
        if self.rollouts.ahead:  # the coming steps' prompts peeked, in the order the steps would take them
            batches, coming = self._lookahead.take(epoch_iterator, num_batches, step)
            for later, prompts in coming:
                self.rollouts.plan(later, prompts)
        else:
            batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.rollouts.open()  # an engine built (vLLM: tens of seconds) before the step's clock starts
        self.stats = StepStats(teacher_sums=self.teacher.new_sums(device))
        student = self.accelerator.unwrap_model(self.model)
        records = self.rollouts.next_step(student, batches, step) if batches else []
        versions = [r.policy_version for r in records if r.policy_version is not None]
        if versions:
            self.stats.staleness = step - min(versions)
        # The sync check compares an engine with the current weights: rollouts sampled ahead were not.
        self._check_sync_now = self._sync_checks_left > 0 and any(
            r.sampling_logprobs_BT is not None and r.policy_version is None for r in records
        )
        self._sync_checks_left -= self._check_sync_now
        # Sampled ahead: the first micro-batch's gap against the weights that sampled it (`_sampler_gap`).
        self._sampler_gap_now = any(
            r.sampling_logprobs_BT is not None and r.policy_version is not None for r in records
        )
        self._check_sampler_now = self._sampler_checks_left > 0 and self._sampler_gap_now
        self._sampler_checks_left -= self._check_sampler_now
        samples = [self._micro_batch(r) for r in records]
        if samples:  # e.g. a served teacher: the step's rows sent now
            self.teacher.prepare([(s["record"], s["teacher_inputs"]) for s in samples], step + 1)
        if self.args.save_rollouts and self.run:
            self._save_rollouts(samples, step + 1)
        n_local = sum(
            (self.teacher.loss_count(s["record"], s["teacher_inputs"]) for s in samples),
            torch.zeros((), device=device),
        ).float()
        n_global = self.accelerator.reduce(n_local, reduction="sum") if self.args.world_size > 1 else n_local
        return samples, n_global.clamp(min=1.0)

    def _check_async(self) -> None:
        """What sampling ahead (`rollout_ahead`) and its correction (`async_correction`) need; each failure
        one line."""
        a = self.args
        OPDSettings.normalise(a)
        if a.rollout_ahead and self.is_fsdp_enabled and a.world_size > 1:
            raise ConfigError(
                f"rollout_ahead={a.rollout_ahead} sends each process's producer the whole student, and a "
                "sharded student (parallelism fsdp) holds a part of it in each process: use parallelism "
                "ddp, or rollout_ahead 0."
            )
        gpu = int(a.rollout_device.partition(":")[2] or 0) if a.rollout_device.startswith("cuda") else -1
        if gpu >= torch.cuda.device_count():
            raise ConfigError(
                f"rollout_device={a.rollout_device} places the rollout producer on a GPU this process does "
                f"not see ({torch.cuda.device_count()} visible): name a visible one, or leave rollout_device "
                "empty for the trainer's device."
            )
        if a.async_correction != "none" and not self.teacher.importance_weighted:
            raise ConfigError(
                f"async_correction={a.async_correction} weights the exact divergence per token; the "
                f"{self.teacher.name}'s divergence takes no weights: use async_correction none."
            )

    def _engine_rollouts(self) -> RolloutSource:
        """The default source: `rollout_engine`, synced with the student once per optimizer step, or with
        `rollout_ahead` >= 1 a producer process sampling that many steps ahead through the same engine, built
        by the same factory there (`ahead.AheadRollouts`; one per training process, sampling that process's
        rows of the step's global batch). The factory holds no reference to the trainer (a cycle would keep a
        finished trainer's models alive until a garbage collection)."""
        a, tok = self.args, self.processing_class
        settings = engines.SamplingSettings(
            max_new_tokens=a.rollout_max_new_tokens,
            temperature=a.rollout_temperature,
            top_p=a.rollout_top_p,
            eos_token_ids=self.stop_ids,
            pad_token_id=tok.pad_token_id,
        )
        if a.environment and self.environment is None:
            raise ConfigError(
                f"environment={a.environment}: the trainer plays episodes against an environment object; "
                "build the trainer with opd.build.distill_trainer, or pass "
                "environment=tasks.get_environment(...)."
            )
        student = self.accelerator.unwrap_model(self.model)
        if a.rollout_engine == "hf":
            # Only a sharded student's forward is a collective that ranks must enter together. A producer
            # sampling ahead reports each token's log-probability, as vLLM does (the importance ratio's).
            synced = self.is_fsdp_enabled and a.world_size > 1
            make = functools.partial(engines.make_engine, "hf", synced=synced, logprobs=bool(a.rollout_ahead))
        else:
            make = functools.partial(
                engines.make_engine,
                "vllm",
                model_path=student.config.name_or_path,
                dtype="bfloat16" if a.bf16 else "float32",
                gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                sleep=a.vllm_sleep,
                max_model_len=a.vllm_max_model_len,
                # one engine across the training processes; a producer's engine is its own
                distributed=a.world_size > 1 and not a.rollout_ahead,
            )
        if a.rollout_ahead:
            engines.check_available(a.rollout_engine)  # here, in one line, not in the producer
            return AheadRollouts(
                make,
                student.config,
                settings,
                a.seed,
                a.process_index,
                a.world_size,
                a.train_batch_size,
                a.rollout_ahead,
                a.device,
                a.rollout_device or None,
            )
        if self.environment is not None:
            return MultiTurnRollouts(
                make,
                settings,
                a.seed,
                a.process_index,
                a.world_size,
                a.train_batch_size,
                environment=self.environment,
                tokenizer=tok,
                max_turns=a.max_turns,
                episode_max_tokens=a.episode_max_tokens,
                enable_thinking=getattr(self.data_collator, "enable_thinking", False),
            )
        return EngineRollouts(make, settings, a.seed, a.process_index, a.world_size, a.train_batch_size)

    def engine(self) -> engines.HFEngine | engines.VLLMEngine:
        """The rollout engine of the default source, built at the first use (a job evaluates through it)."""
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
        `engines.VLLMEngine.close`); the job calls it however the run ends."""
        self.rollouts.close()

    def micro_batch(self, record: RolloutRecord) -> dict:
        """What `compute_loss` takes for a record: the record, the teacher's own inputs of it
        (`Teacher.inputs`), and its `input_ids` (transformers' `Trainer` counts a step's tokens from them)."""
        return {
            "input_ids": record.input_ids_BT,
            "record": record,
            "teacher_inputs": self.teacher.inputs(record),
        }

    def _micro_batch(self, record: RolloutRecord) -> dict:
        self.stats.sequences += record.input_ids_BT.shape[0]
        self.stats.completion_tokens += record.loss_mask_BT.sum()
        self.stats.truncated += record.truncated_B.sum()
        return self.micro_batch(record)

    def _save_rollouts(self, samples: list[dict], step: int) -> None:
        folder = self.run.path / "rollouts"
        folder.mkdir(exist_ok=True)
        keep = []
        for s in samples:
            tensors = {**s["record"].tensors(), **self.teacher.saved(s["teacher_inputs"])}
            keep.append({k: v.cpu() for k, v in tensors.items()})
        torch.save(keep, folder / f"step{step:06d}-rank{self.args.process_index}.pt")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        record, own = inputs["record"], inputs["teacher_inputs"]
        ids_BT, attn_BT = record.input_ids_BT, record.attention_mask_BT
        pos_BT = sampling.position_ids_from_mask(attn_BT)
        pred_BT = record.predicting_BT()  # the loss mask shifted by one: the state at t predicts token t+1
        fwd = dict(input_ids=ids_BT, attention_mask=attn_BT, position_ids=pos_BT, use_cache=False)
        part = self.teacher.score(record, own, fwd, pred_BT)
        target_N = engine_logp_N = None
        if record.sampling_logprobs_BT is not None:
            # Selected here, where the scoring above has already waited for the device, not after the
            # student's forward: the sampled token each predicting position was followed by, and the
            # engine's log-probability of it (both in the loss mask's order).
            target_N = ids_BT[:, 1:][pred_BT[:, :-1]]
            engine_logp_N = record.sampling_logprobs_BT[record.loss_mask_BT.bool()]
        student = self.accelerator.unwrap_model(model)
        stale = record.policy_version is not None and engine_logp_N is not None
        if stale and self._sampler_gap_now:
            self._sampler_gap_now = False
            self._sampler_gap(student, record, fwd, pred_BT, target_N, engine_logp_N)
        correct = stale and self.args.async_correction == "truncated"
        given = DivergenceInputs(
            beta=self.args.beta,
            temperature=self.args.kl_temperature,
            vocab_size=self.vocab_size,
            chunk_size=self.args.loss_chunk_size,
            target_ids_N=target_N,
            behaviour_logprobs_N=engine_logp_N if correct else None,
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
        if engine_logp_N is not None:
            token_logp_N = out.student_token_logprob_N
            gap_N = (token_logp_N - engine_logp_N.to(token_logp_N)).abs()
            self.stats.gap_sum += gap_N.sum()
            self.stats.gap_tokens += gap_N.shape[0]
            if self._check_sync_now:
                self._check_sync_now = False
                self._check_sync(gap_N)
            if stale:
                log_ratio_N = token_logp_N - engine_logp_N.to(token_logp_N)
                self.stats.add_ratios(log_ratio_N, self.args.async_ratio_cap)
        if sums is not None:
            acc = self.stats.teacher_sums
            self.stats.teacher_sums = sums if acc is None else acc + sums.to(acc)
        self._keep_samples(record, pred_BT, out.per_token_N)
        return (loss, out) if return_outputs else loss

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, the teacher's fingerprint first (where its kind has one): saved beside the
        checkpoints (`TEACHER_SET_FILE`) when the run starts, compared when it resumes (another teacher: one
        line, before any step)."""
        self._check_fingerprint(resume_from_checkpoint)
        self._resume_queued(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _resume_queued(self, resume_from_checkpoint) -> None:
        """Rollouts sampled ahead: the steps the checkpoint had queued are regenerated by the weights that
        sampled them in the unbroken run (kept in the checkpoint, `ahead.QUEUED_FILE`), so the resumed run
        samples what the unbroken one did. A checkpoint without them (a synchronous run's) resumes with its
        first step sampled by the current weights."""
        if not (resume_from_checkpoint and isinstance(self.rollouts, AheadRollouts)):
            return
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        queued = load_queued(resume_from_checkpoint) if resume_from_checkpoint else None
        if queued is None:
            if self.args.process_index == 0:
                print(
                    f"resume: {resume_from_checkpoint} keeps no rollouts sampled ahead; its first step is "
                    "sampled by the current weights (staleness 0)",
                    flush=True,
                )
            return
        self.rollouts.resume(*queued)

    def _save_checkpoint(self, model, trial) -> None:
        """`Trainer._save_checkpoint`, with rollouts sampled ahead first writing what sampled the steps
        queued (`ahead.save_queued`) into the checkpoint folder: before transformers' files, whose
        `trainer_state.json` comes last, so a checkpoint complete by that file has it; inside the folder, so
        `save_total_limit` rotates it with the checkpoint."""
        if isinstance(self.rollouts, AheadRollouts) and self.args.process_index == 0:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            save_queued(self.rollouts, Path(self._get_output_dir(trial=trial)) / name)
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

    def _check_sync(self, gap_N: torch.Tensor, producer: bool = False) -> None:
        """The one host read before a backward pass (first steps only): every rank stops together if the
        micro-batch's gap, summed over all processes, is off. `producer`: the gap of a producer sampling ahead
        against the weights it was sent; its engine's dtype: vLLM's as configured, the kit's loop float32."""
        sums = torch.stack([gap_N.sum(), torch.tensor(float(gap_N.shape[0]), device=gap_N.device)]).double()
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        if producer:
            vllm_bf16 = self.args.rollout_engine == "vllm" and self.args.bf16
            dtype, who = ("bfloat16" if vllm_bf16 else "float32"), "rollout producer's"
        else:
            dtype, who = self.engine().dtype, "vLLM engine's"
        engines.check_sync(*sums.tolist(), dtype=dtype, step=self.state.global_step + 1, who=who)

    def _sampler_gap(self, student, record, fwd, pred_BT, target_N, engine_logp_N) -> None:
        """Rollouts sampled ahead, the step's first micro-batch only (one extra forward per step, no
        gradient): |log p_engine(y_t) - log p_version(y_t)| over its sampled tokens, p_version the student
        under the weights that sampled them (`AheadRollouts.weights_of`, through `ahead.logprobs_under`: no
        copy of the model, a transient one of the weights on its device), float32, temperature 1. Zero but for
        rounding when the producer loaded what it was sent: unlike `engine_logprob_gap` (against the current
        weights) it does not grow with staleness, so a wrong weight load in the producer shows here. In the
        first `SYNC_CHECK_STEPS` steps sampled ahead, a gap that is off stops the run (`_check_sync`)."""
        state = self.rollouts.weights_of(record.policy_version)
        if state is None:
            return
        version_logp_N = logprobs_under(student, state, fwd, pred_BT, target_N, self.args.loss_chunk_size)
        gap_N = (version_logp_N - engine_logp_N.to(version_logp_N)).abs()
        self.stats.sampler_gap = torch.stack([gap_N.sum(), gap_N.new_tensor(float(gap_N.shape[0]))]).double()
        if self._check_sampler_now:
            self._check_sampler_now = False
            self._check_sync(gap_N, producer=True)

    def _keep_samples(self, record: RolloutRecord, pred_BT, per_token_N) -> None:
        """Keep the rows sampled first in the step (micro-batches are grouped by length, so these are a
        fair draw, not the shortest) as device tensors; `_sample_records` reads them at logging time."""
        step = self.state.global_step + 1
        per_log = self.args.samples_per_log
        if not (self.run and self.args.sample_every and step % self.args.sample_every == 0):
            return
        keep = [b for b, place in enumerate(record.sampled_as) if place < per_log]
        if not keep:
            return
        self._step_samples.append(
            {
                "step": step,
                "keep": keep,
                "record": record,
                "pred_BT": pred_BT,
                "per_token_N": per_token_N,  # every row's predicting positions, row after row
            }
        )

    def _sample_records(self) -> list[dict]:
        """The kept samples as samples.jsonl records in sampling order, one host copy per kept micro-batch:
        each row's context (the tokens before its first loss token), its loss tokens and their divergence."""
        tok, records = self.processing_class, []
        for s in self._step_samples:
            r = s["record"]
            ids_BT, context_BT, loss_BT = r.input_ids_BT.cpu(), r.context_BT().cpu(), r.loss_mask_BT.cpu()
            counts = s["pred_BT"].sum(1).cpu().tolist()
            divs = s["per_token_N"].cpu().split(counts)
            for b in s["keep"]:
                place = r.sampled_as[b]
                record = {
                    "step": s["step"],
                    "prompt": tok.decode(ids_BT[b][context_BT[b]]),
                    "tokens": tok.convert_ids_to_tokens(ids_BT[b][loss_BT[b].bool()].tolist()),
                    "divergence": [round(d, 5) for d in divs[b].tolist()],
                    "answer": r.answers[b],
                }
                turns = _turns(ids_BT[b], loss_BT[b], r.attention_mask_BT[b].cpu())
                if (
                    len(turns) > 1
                ):  # a multi-turn episode: its parts in order, the tools' between the student's
                    record["turns"] = [
                        {"sampled": m, "text": tok.decode(t), **({"n_tokens": len(t)} if m else {})}
                        for m, t in turns
                    ]
                records.append(((s["step"], place), record))
        return [record for _, record in sorted(records, key=lambda r: r[0])]

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
        step = opt.step
        # Trainer and optimizer held weakly (the optimizer's own step unbound): `opt.step` referring back
        # to them would be a reference cycle keeping the model and the AdamW state alive after training.
        me, opt_ref = weakref.ref(self), weakref.ref(opt)
        unbound = step.__func__ if getattr(step, "__self__", None) is opt else None
        if unbound is not None:
            del step

        def guarded_step(*args, **kwargs):
            # A non-finite gradient must never reach the weights: skip the update, the run then stops.
            # Before any measured step the optimizer must step: loading a sharded optimizer state
            # (FSDP resume) first creates the state with one zero-lr step.
            norm = getattr(me(), "last_grad_norm", None)
            if norm is None or math.isfinite(norm):
                return unbound(opt_ref(), *args, **kwargs) if unbound is not None else step(*args, **kwargs)
            return None

        opt.step = guarded_step
        return opt

    def log(self, logs: dict, start_time: float | None = None) -> None:
        if "loss" in logs and "grad_norm" in logs:
            logs.update(self._step_metrics(logs))
        elif "eval_accuracy" in logs and self.run and self.args.process_index == 0:
            evals = {k: v for k, v in logs.items() if k.startswith("eval_")}  # eval_tool_call_share too
            self.run.log({"step": self.state.global_step, **evals})
        super().log(logs, start_time)

    def _step_metrics(self, logs: dict) -> dict:
        sums = self.stats.as_tensor(self.args.device)
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        seqs, toks, trunc, ent, gap, gap_toks = sums[:6].tolist()
        teacher_sums = sums[6:].tolist() if self.stats.teacher_sums is not None else None
        elapsed = max(time.time() - self.stats.started, 1e-9)
        max_norm = self.args.max_grad_norm
        record = {
            "step": self.state.global_step,
            "loss": logs["loss"],
            "grad_norm": logs["grad_norm"],
            "clipped": bool(max_norm and math.isfinite(max_norm) and logs["grad_norm"] > max_norm),
            "lr": logs.get("learning_rate"),
            "completion_length": toks / max(seqs, 1),
            "truncated_fraction": trunc / max(seqs, 1),
            "entropy": ent / max(toks, 1) if self.teacher.gives_entropy else None,
            "tokens_per_s": toks / elapsed,
            "completion_tokens": toks,
            # Mean |log p_engine - log p_student| of the sampled tokens: a stale or wrong weight sync
            # shows here.
            "engine_logprob_gap": gap / gap_toks if gap_toks else None,
        }
        # The kind's own: each teacher's divergence of a set, a served teacher's gap to its reference, the
        # label of an approximate divergence beside the loss.
        record.update(self.teacher.metrics(teacher_sums))
        if self.rollouts.ahead:
            record.update(self._async_metrics())
        record.update(self._tool_metrics())
        if self.run and self.args.process_index == 0:
            self.run.log(record)
            for s in self._sample_records():
                self.run.log(s, "samples.jsonl")
        self._step_samples = []
        return {k: v for k, v in record.items() if k not in ("step", "loss", "grad_norm")}

    def _tool_metrics(self) -> dict:
        """Multi-turn episodes (a source with `counts`): over all processes, the share of episodes that
        called a tool, tool calls per episode, malformed calls (count and share of the calls), turns per
        episode, and the share graded correct by the environment. Nothing for single-turn rollouts."""
        counts = getattr(self.rollouts, "counts", None)
        if not counts:
            return {}
        names = list(counts)
        sums = torch.tensor([float(counts[k]) for k in names], dtype=torch.float64, device=self.args.device)
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        c = dict(zip(names, sums.tolist()))
        episodes, calls = max(c["episodes"], 1.0), c["calls"]
        return {
            "tool/episodes": c["episodes"],
            "tool/called_share": c["called_tool"] / episodes,
            "tool/call_correct_share": c["tool_correct"] / episodes,
            "tool/calls_per_episode": calls / episodes,
            "tool/malformed": c["malformed"],
            "tool/malformed_share": c["malformed"] / calls if calls else None,
            "tool/turns_mean": c["turns"] / episodes,
            "tool/accuracy": c["correct"] / episodes,
        }

    def _async_metrics(self) -> dict:
        """Rollouts sampled ahead: the step's staleness (trainer step - the sampling weights' version) and its
        importance ratios pi_student / pi_sampler over the loss tokens: mean, maximum, share above the cap
        (capped where `async_correction` is truncated), and the engine's log-prob gap to the weights that
        sampled (first micro-batch), over all processes."""
        ratios = self.stats.ratios
        ratios = ratios if ratios is not None else torch.zeros(4, dtype=torch.float64)
        ratios = ratios.to(self.args.device)
        if self.args.world_size > 1 and dist.is_initialized():
            sums, top = ratios[:3].clone(), ratios[3:].clone()
            dist.all_reduce(sums)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            ratios = torch.cat([sums, top])
        ratio_sum, tokens, capped, top = ratios.tolist()
        gap = self.stats.sampler_gap
        gap = (gap if gap is not None else torch.zeros(2, dtype=torch.float64)).to(self.args.device)
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(gap)
        gap_sum, gap_tokens = gap.tolist()
        return {
            "async/staleness": self.stats.staleness,
            "async/ratio_mean": ratio_sum / tokens if tokens else None,
            "async/ratio_max": top if tokens else None,
            "async/capped_share": capped / tokens if tokens else None,
            # against the weights that sampled the step's first micro-batch (`_sampler_gap`)
            "async/sampler_logprob_gap": gap_sum / gap_tokens if gap_tokens else None,
        }


def _turns(ids_T: torch.Tensor, loss_T: torch.Tensor, attn_T: torch.Tensor) -> list[tuple[bool, list[int]]]:
    """A row after its context as runs of (sampled by the student, token ids): the student's turns (loss mask
    1) and what came between them (the template's and the tools' tokens, attended, mask 0)."""
    runs: list[tuple[bool, list[int]]] = []
    first = loss_T.bool().nonzero()
    if not len(first):
        return runs
    for i, m, a in zip(
        ids_T.tolist()[int(first[0]) :], loss_T.tolist()[int(first[0]) :], attn_T.tolist()[int(first[0]) :]
    ):
        if not a:
            continue
        if runs and runs[-1][0] == bool(m):
            runs[-1][1].append(i)
        else:
            runs.append((bool(m), [i]))
    return runs


class _HeldRecord(TrainerCallback):
    """When training begins (the student prepared, sharded under FSDP; the teacher placed or sharded), each
    process records what it holds of both models, counted on the tensors (`memory.held_by`): printed, and
    written to the run folder's held/rank<k>.json, so that a sharding that silently failed shows."""

    def __init__(self, trainer: DistillTrainer):
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is None:
            return
        models = {"student": trainer.model, "teacher": trainer.teacher.module}
        held = {role: memory.held_by(m) for role, m in models.items() if isinstance(m, torch.nn.Module)}
        record = {"rank": args.process_index, "world_size": args.world_size, "models": held}
        print(memory.held_line(record), flush=True)
        if trainer.run is not None:
            folder = trainer.run.path / memory.HELD_DIR
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / f"rank{args.process_index}.json", json.dumps(record, indent=2))


class _NonFiniteStop(TrainerCallback):
    """Stops training after a non-finite step. Its trainer is held weakly: the trainer holds this callback,
    and a strong reference back would be a cycle keeping a finished trainer's models (and on a GPU their
    memory) alive until a garbage collection happens to run."""

    def __init__(self, trainer: DistillTrainer):
        self._trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs):
        trainer = self._trainer()
        if trainer is not None and trainer.first_nonfinite_step is not None:
            control.should_training_stop = True
            control.should_save = False  # keep the last good checkpoint as the newest one
        return control
