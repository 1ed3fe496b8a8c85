"""`DistillTrainer`: white-box on-policy distillation on transformers' `Trainer`.

One optimizer step:
1. `get_batch_samples` pulls the step's prompt micro-batches; the rollout engine (`rollout_engine`: the
   kit's KV-cached loop, or vLLM colocated in this process with the student's weights synced first)
   samples a completion for every prompt of the step in one call; the rows are regrouped by completion
   length into micro-batches of the same sizes, each trimmed to its own longest row, so the forward and
   backward passes skip most of the padding (`microbatches.length_order`), and the completion tokens of the
   whole step are counted across processes (N);
2. `compute_loss`, per micro-batch, runs student and frozen teacher over prompt+completion with the
   positions the sampler used (under FSDP both sharded, each part run as its own model's forward), and
   sums the per-token divergence over completion tokens from the final hidden states in chunks
   (`chunked_divergence`), divided by N; so batch size x gradient accumulation x processes never changes
   the gradient. The student's part (backbone and head) runs
   as the wrapped student's forward, so DDP's and FSDP's hooks enclose it (`sharding.call_inside_forward`);
   with vLLM the same pass reads the student's log-probability of each sampled token, compared with the
   engine's (`engine_logprob_gap`) without a second forward;
3. `Trainer` clips (`max_grad_norm`) and steps; a non-finite gradient skips the step and ends the run
   with the last good weights.

Step statistics stay on the device (no host read between forward and backward) until a logging step
reads them once, samples for samples.jsonl included (the rows sampled first, whatever micro-batch their
length put them in). The exception: with vLLM the first micro-batch of each
of the first `SYNC_CHECK_STEPS` steps reads its gap and stops the run (`engines.WeightSyncError`) before the
backward pass if the engine's log-probabilities differ from the student's by more than rounding. In a fresh
run the engine loaded the first step's weights from the student's own folder, so a wrong sync first shows
at the second step (after a resume, at the first).
"""

from __future__ import annotations

import json
import math
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

from opdkit import memory
from opdkit.models import TokenizerMismatch, check_tokenizers, eos_ids, load_model
from opdkit.opd import crossteacher, microbatches, mixture, served, topk
from opdkit.opd.arguments import OPDArguments
from opdkit.opd.loss import DivergenceOutput, chunked_divergence
from opdkit.rollout import engines, sampling
from opdkit.run import sharding
from opdkit.run.files import atomic_write_text
from opdkit.run.folders import RunDir

SYNC_CHECK_STEPS = 2
TEACHER_SET_FILE = "teachers.json"  # several teachers: each one's fingerprint, compared at a resume


def check_vocab_sizes(
    student: PreTrainedModel, teacher: PreTrainedModel | None, tokenizer, teacher_tokenizer=None
) -> int:
    """The number of logits compared: the tokenizer's size (models may pad their vocabulary beyond it); a
    teacher with a tokenizer of its own (`teacher_tokenizer`) is checked against that one; None: a teacher
    without a head here (top-K log-probabilities), the student alone."""
    vocab = len(tokenizer)
    for name, model, tok in (
        ("student", student, tokenizer),
        ("teacher", teacher, teacher_tokenizer or tokenizer),
    ):
        if model is None:
            continue
        rows = model.get_output_embeddings().weight.shape[0]
        if rows < len(tok):
            raise TokenizerMismatch(
                f"the {name} has {rows} output rows but the tokenizer has {len(tok)} tokens; "
                "the model and tokenizer do not belong together."
            )
    return vocab


def student_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    t_hidden_NH: torch.Tensor,
    teacher_head_VH: torch.Tensor,
    **divergence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The student's part of the loss: its backbone over `fwd`, the final hidden states where
    `pred_BT` marks a predicted completion token, and `chunked_divergence` against the teacher's
    with the student's own head weight: (summed divergence, per-token divergence, student entropy,
    student log-probability of each `target_ids_N` token if given).

    Run it as the student's forward (`sharding.call_inside_forward`): under FSDP the head weight (tied
    to the embedding in Qwen3-0.6B) is whole only there. A tuple of tensors, not a dataclass, so that
    the wrapper finds the output it hooks the backward pass on.
    """
    s_hidden_NH = student.base_model(**fwd).last_hidden_state[pred_BT]
    s_head_VH = student.get_output_embeddings().weight
    # The backbone runs under the caller's autocast; the heads' matmuls in their weights' dtypes (the
    # float32 student under DDP, FSDP's bf16 compute copy under its mixed precision).
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out = chunked_divergence(s_hidden_NH, s_head_VH, t_hidden_NH, teacher_head_VH, **divergence)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N


def student_topk_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    t_ids_NK: torch.Tensor,
    t_logprobs_NK: torch.Tensor,
    **divergence,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`student_divergence` against a teacher's top-K log-probabilities (`teacher_logprobs: topk:K`):
    `topk.chunked_topk_divergence`, the approximate divergence, from the student's own states and head."""
    s_hidden_NH = student.base_model(**fwd).last_hidden_state[pred_BT]
    s_head_VH = student.get_output_embeddings().weight
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out = topk.chunked_topk_divergence(s_hidden_NH, s_head_VH, t_ids_NK, t_logprobs_NK, **divergence)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N


def student_weighted_divergence(
    student: PreTrainedModel,
    fwd: dict,
    pred_BT: torch.Tensor,
    teachers: list[tuple[float, torch.Tensor, torch.Tensor]],
    **divergence,
) -> tuple[torch.Tensor, ...]:
    """`student_divergence` against several teachers at once (`mixture.WeightedTeachers`): sum_k w_k D_k
    (`mixture.weighted_divergence`), then each teacher's own per-token divergence, stacked (K, N), to log."""
    s_hidden_NH = student.base_model(**fwd).last_hidden_state[pred_BT]
    s_head_VH = student.get_output_embeddings().weight
    with torch.autocast(s_hidden_NH.device.type, enabled=False):
        out, each = mixture.weighted_divergence(s_hidden_NH, s_head_VH, teachers, **divergence)
    each_KN = torch.stack(each)
    return out.sum, out.per_token_N, out.student_entropy_N, out.student_token_logprob_N, each_KN


Number = float | torch.Tensor


@dataclass
class StepStats:
    """Per-step sums, device tensors where they come from the step's tensors (read when logged, reduced
    across processes then)."""

    sequences: Number = 0.0
    completion_tokens: Number = 0.0
    truncated: Number = 0.0
    entropy_sum: Number = 0.0
    gap_sum: Number = 0.0  # sum of |log p_engine - log p_student| over completion tokens (vllm)
    gap_tokens: Number = 0.0
    teacher_gap_sum: Number = 0.0  # sum of |log p_served - log p_reference| (a served teacher's first steps)
    teacher_gap_tokens: Number = 0.0
    # several teachers: each one's summed per-token divergence, then its token count (2 x teachers)
    per_teacher: torch.Tensor | None = None
    started: float = field(default_factory=time.time)

    def as_tensor(self, device) -> torch.Tensor:
        vals = [
            self.sequences,
            self.completion_tokens,
            self.truncated,
            self.entropy_sum,
            self.gap_sum,
            self.gap_tokens,
            self.teacher_gap_sum,
            self.teacher_gap_tokens,
        ]
        out = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in vals])
        if self.per_teacher is None:
            return out
        return torch.cat([out, self.per_teacher.to(device, torch.float64)])


class DistillTrainer(Trainer):
    """White-box on-policy distillation on `Trainer`: `args` is an `OPDArguments`, `processing_class` the
    student's tokenizer, `teacher_model` the frozen teacher (its tokenizer, if given, is checked against the
    student's); `run` receives metrics.jsonl, samples.jsonl and rollouts/. The teacher is used through
    `base_model(...).last_hidden_state` and `get_output_embeddings().weight` only, so any frozen module that
    presents these scores (antidistillation's `ADSTeacher` serves its ADS logits this way)."""

    def __init__(
        self,
        *args,
        teacher_model: PreTrainedModel,
        teacher_tokenizer: PreTrainedTokenizerBase | None = None,
        run: RunDir | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, OPDArguments):
            raise TypeError(f"DistillTrainer needs args=OPDArguments(...), got {type(self.args).__name__}.")
        tok = self.processing_class
        if tok is None:
            raise ValueError("DistillTrainer needs the student's tokenizer as processing_class=...")
        # A teacher given as top-K log-probabilities (`topk.TopKTeacher`, teacher_logprobs topk:K) has no
        # head here: the loss is the approximate top-K divergence, on the student's vocabulary, at
        # temperature 1 (the served log-probabilities are at 1).
        self.topk = teacher_model if isinstance(teacher_model, topk.TopKTeacher) else None
        if self.topk is not None:
            if crossteacher.differ(tok, teacher_tokenizer):
                raise ValueError(
                    "teacher_logprobs topk needs a teacher with the student's tokenizer (the served ids are "
                    "the student's vocabulary); use teacher_logprobs exact for a teacher with another one."
                )
            if self.args.kl_temperature != 1.0:
                raise ValueError(topk.TEMPERATURE_REFUSAL.format(temperature=self.args.kl_temperature))
            if self.args.process_index == 0:
                print(f"teacher_logprobs {self.topk.label}: the loss is APPROXIMATE", flush=True)
        # Several teachers (`mixture`): rows routed by their `teacher_id` (`RoutedTeacher`, one stacked
        # teacher to the loss) or every row scored by all (`WeightedTeachers`, sum_k w_k D_k); each
        # teacher's divergence logged, the set fingerprinted and checked at a resume (`train`).
        self.teacher_set = mixture.teacher_set(teacher_model)
        self.teacher_ids = list(self.teacher_set) if self.teacher_set else []
        self.weighted = teacher_model if isinstance(teacher_model, mixture.WeightedTeachers) else None
        if self.teacher_set is not None and crossteacher.differ(tok, teacher_tokenizer):
            raise ValueError(
                "several teachers need the student's tokenizer (each is compared logit by logit); a teacher "
                "with another tokenizer can only be the one teacher of a run."
            )
        # A teacher with another tokenizer reads the completions re-tokenized and is compared through GOLD's
        # cross-tokenizer loss (`crossteacher`); None: the two share one vocabulary.
        self.crosstok = None
        if crossteacher.differ(tok, teacher_tokenizer):
            self.crosstok = crossteacher.CrossTeacher.of(tok, teacher_tokenizer, self.args)
        else:
            check_tokenizers(tok, teacher_tokenizer or tok)
        single = self.topk is None and self.weighted is None
        self.vocab_size = check_vocab_sizes(
            self.model, teacher_model if single else None, tok, teacher_tokenizer
        )
        for t in self.weighted.teachers.values() if self.weighted is not None else ():
            check_vocab_sizes(self.model, t, tok)
        self.teacher_vocab_size = len(teacher_tokenizer) if self.crosstok else self.vocab_size
        # A completion ends at the tokenizer's EOS or any the student's generation config lists (Qwen3:
        # <|im_end|> and <|endoftext|>); what follows a stop token is never sampled into the loss.
        self.stop_ids = eos_ids(tok, self.model)
        self.teacher = teacher_model.eval().requires_grad_(False)
        # Under FSDP the frozen teacher is sharded like the student (weights only: it has no gradients or
        # optimizer state), so its memory per process falls with the process count. Sharding moves each
        # unit to the device as it shards it, so a teacher loaded in host memory is never whole on a GPU.
        # A served teacher (`served.ServedTeacher`) holds only its head here: nothing to shard.
        served = hasattr(self.teacher, "prepare_step")
        self.teacher_sharded = self.is_fsdp_enabled and self.args.world_size > 1 and not served
        if self.teacher_sharded:
            sharding.shard_frozen(self.teacher)
        else:
            self.teacher.to(self.args.device)
        self.run = run
        self.model_accepts_loss_kwargs = True  # we normalise by num_items_in_batch ourselves
        self.stats = StepStats()
        self.last_grad_norm: float | None = None  # None: no step measured yet
        self.first_nonfinite_step: int | None = None
        self._step_samples: list[dict] = []  # tensors until a logging step writes them
        self._engine: engines.HFEngine | engines.VLLMEngine | None = None
        self._sync_checks_left = SYNC_CHECK_STEPS
        self._check_sync_now = False  # set per step: the step's first micro-batch checks the gap
        # A served teacher with a reference in process: its states x head against it on the first steps.
        self.teacher_reference = getattr(self.teacher, "reference", None)
        self._teacher_checks_left = SYNC_CHECK_STEPS if self.teacher_reference is not None else 0
        self._check_teacher_now = False
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
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        step = self.state.global_step
        engine = self.engine()  # built (a vLLM engine: tens of seconds) before the step's clock starts
        self.stats = StepStats()
        self._check_teacher_now = self._teacher_checks_left > 0
        self._teacher_checks_left -= self._check_teacher_now
        if self.teacher_ids:
            self.stats.per_teacher = torch.zeros(2 * len(self.teacher_ids), device=device)
        samples = self._rollout_step(engine, batches, step) if batches else []
        if samples and hasattr(self.teacher, "prepare_step"):  # a served teacher: the step's rows sent now
            self.teacher.prepare_step(samples)
        if self.args.save_rollouts and self.run:
            self._save_rollouts(samples, step + 1)
        if self.crosstok is not None:  # the cross-tokenizer loss is a mean over the step's groups
            n_local = sum((s["crosstok_groups"] for s in samples), torch.zeros((), device=device)).float()
        else:
            n_local = sum(
                (s["completion_mask_BC"].sum() for s in samples), torch.zeros((), device=device)
            ).float()
        n_global = self.accelerator.reduce(n_local, reduction="sum") if self.args.world_size > 1 else n_local
        return samples, n_global.clamp(min=1.0)

    def engine(self) -> engines.HFEngine | engines.VLLMEngine:
        """The rollout engine, built at the first rollout."""
        if self._engine is None:
            a = self.args
            if a.rollout_engine == "hf":
                # Only a sharded student's forward is a collective that ranks must enter together.
                self._engine = engines.make_engine("hf", synced=self.is_fsdp_enabled and a.world_size > 1)
            else:
                student = self.accelerator.unwrap_model(self.model)
                self._engine = engines.make_engine(
                    "vllm",
                    model_path=student.config.name_or_path,
                    dtype="bfloat16" if a.bf16 else "float32",
                    gpu_memory_utilization=a.vllm_gpu_memory_utilization,
                    sleep=a.vllm_sleep,
                    max_model_len=a.vllm_max_model_len,
                    distributed=a.world_size > 1,
                )
        return self._engine

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
        """Shut the rollout engine down when the run is over (a vLLM engine gives its memory back; see
        `engines.VLLMEngine.close`); the job calls it however the run ends."""
        if self._engine is not None:
            self._engine.close()

    def _rollout_step(self, engine, batches: list[dict], step: int) -> list[dict]:
        """All of the step's prompts sampled in one engine call, then regrouped by completion length
        (`microbatches.length_order`) and cut back into micro-batches of the same sizes. Each row is sampled
        from its own stream, keyed by (seed, step, its place in the step's global batch)
        (`engines.rollout_seeds`, `microbatches.global_places`): 1, 2 or 8 processes draw the same
        completions for the same prompts, and a resumed run samples exactly what an unbroken run would
        have, whatever the RNG history before the checkpoint."""
        tok = self.processing_class
        model = self.accelerator.unwrap_model(self.model)
        # Once per optimizer step, so also before the first rollout after a resume.
        engine.sync(model)
        settings = engines.SamplingSettings(
            max_new_tokens=self.args.max_new_tokens,
            temperature=self.args.gen_temperature,
            top_p=self.args.gen_top_p,
            eos_token_ids=self.stop_ids,
            pad_token_id=tok.pad_token_id,
        )
        ids_BP, mask_BP = microbatches.concat_prompts(batches, tok.pad_token_id)
        sizes = [b["prompts"].shape[0] for b in batches]
        a = self.args
        places = microbatches.global_places(sizes, a.process_index, a.world_size, a.train_batch_size)
        whole = engine.sample(model, ids_BP, mask_BP, settings, engines.rollout_seeds(a.seed, step, places))
        answers = [a for b, n in zip(batches, sizes) for a in (b.get("answers") or [None] * n)]
        owners = [t for b, n in zip(batches, sizes) for t in (b.get("teacher_id") or [None] * n)]
        order_B = microbatches.length_order(whole)
        parts = microbatches.split_rollout(whole.rows(order_B), sizes)
        self._check_sync_now = whole.logprobs_BC is not None and self._sync_checks_left > 0
        self._sync_checks_left -= self._check_sync_now
        places = order_B.split(sizes)  # each micro-batch's rows, as places in the sampling order
        routed = any(t is not None for t in owners)
        return [
            self._sample_dict(
                r,
                rows.tolist(),
                [answers[i] for i in rows.tolist()],
                [owners[i] for i in rows.tolist()] if routed else None,
            )
            for r, rows in zip(parts, places)
        ]

    def _sample_dict(
        self, r: sampling.Rollout, sampled_as: list[int], answers: list, teacher_ids: list | None = None
    ) -> dict:
        """A micro-batch for `compute_loss`; `sampled_as`: each row's place in the step's sampling order."""
        self.stats.sequences += r.input_ids_BT.shape[0]
        self.stats.completion_tokens += r.completion_mask_BC.sum()
        self.stats.truncated += r.truncated_B(self.stop_ids).sum()
        sample = {
            "input_ids": r.input_ids_BT,
            "attention_mask": r.attention_mask_BT,
            "completion_mask_BC": r.completion_mask_BC,
            "answers": answers,
            "sampled_as": sampled_as,
        }
        if teacher_ids is not None:  # each row's teacher (a `teacher_id` column), kept with its row
            sample["teacher_id"] = teacher_ids
        if r.logprobs_BC is not None:  # the engine's; the training forward compares the student's
            sample["engine_logprobs_BC"] = r.logprobs_BC
        if self.crosstok is not None:
            sample.update(
                self.crosstok.prepare(
                    r.input_ids_BT, r.attention_mask_BT, r.completion_mask_BC, self.stop_ids
                )
            )
        return sample

    def _save_rollouts(self, samples: list[dict], step: int) -> None:
        folder = self.run.path / "rollouts"
        folder.mkdir(exist_ok=True)
        keep = [{k: v.cpu() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in samples]
        torch.save(keep, folder / f"step{step:06d}-rank{self.args.process_index}.pt")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids_BT, attn_BT, comp_BC = inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask_BC"]
        pos_BT = sampling.position_ids_from_mask(attn_BT)
        prompt_len = ids_BT.shape[1] - comp_BC.shape[1]
        # The hidden state at t predicts token t+1: completion token j is predicted at P-1+j.
        pred_BT = torch.zeros_like(attn_BT, dtype=torch.bool)
        pred_BT[:, prompt_len - 1 : prompt_len - 1 + comp_BC.shape[1]] = comp_BC.bool()
        fwd = dict(input_ids=ids_BT, attention_mask=attn_BT, position_ids=pos_BT, use_cache=False)
        t_fwd, t_pred_BT = (
            (fwd, pred_BT) if self.crosstok is None else crossteacher.teacher_forward_inputs(inputs)
        )
        if self.topk is not None:  # the teacher's top-K ids and log-probabilities at the predicting positions
            t_ids_NK, t_logp_NK = self.topk.sparse(ids_BT, attn_BT, pred_BT)
        elif self.weighted is not None:  # every teacher's states at the predicting positions, and its head
            with torch.no_grad():
                t_parts = [
                    (
                        self.weighted.weights[tid],
                        t.base_model(**fwd).last_hidden_state[pred_BT],
                        t.get_output_embeddings().weight,
                    )
                    for tid, t in self.weighted.teachers.items()
                ]
        else:
            with torch.no_grad():  # the backbone alone: no other layer's output is kept
                t_hidden_NH, t_head_VH = sharding.call_inside_forward(
                    self.teacher, self.teacher, self._teacher_part, t_pred_BT, **t_fwd
                )
            if self._check_teacher_now:
                self._check_teacher_now = False
                self._check_teacher(t_hidden_NH, t_head_VH, t_fwd, t_pred_BT)
        target_N = engine_logp_N = None
        if "engine_logprobs_BC" in inputs:
            # Selected here, where the selection above has already waited for the device, not after the
            # student's forward: the sampled token each predicting position was followed by, and the
            # engine's log-probability of it (pred_BT's completion columns are comp_BC, in the same order).
            target_N = ids_BT[:, 1:][pred_BT[:, :-1]]
            engine_logp_N = inputs["engine_logprobs_BC"][comp_BC.bool()]
        student = self.accelerator.unwrap_model(model)

        # Every divergence takes these; the ones on one vocabulary also the temperature and its width.
        common = dict(beta=self.args.beta, chunk_size=self.args.loss_chunk_size, target_ids_N=target_N)
        one_vocab = dict(common, temperature=self.args.kl_temperature, vocab_size=self.vocab_size)

        def student_part(**fwd):
            if self.weighted is not None:
                return student_weighted_divergence(student, fwd, pred_BT, t_parts, **one_vocab)
            if self.topk is not None:
                return student_topk_divergence(student, fwd, pred_BT, t_ids_NK, t_logp_NK, **one_vocab)
            if self.crosstok is not None:
                return crossteacher.student_cross_divergence(
                    student,
                    fwd,
                    pred_BT,
                    t_hidden_NH,
                    t_head_VH,
                    inputs["crosstok_alignment"],
                    self.crosstok,
                    student_vocab_size=self.vocab_size,
                    teacher_vocab_size=self.teacher_vocab_size,
                    **common,
                )
            return student_divergence(student, fwd, pred_BT, t_hidden_NH, t_head_VH, **one_vocab)

        # The model's own forward runs under accelerate's autocast (bf16); the redirected one must too.
        with self.accelerator.autocast():
            parts = sharding.call_inside_forward(model, student, student_part, **fwd)
        if self.weighted is not None:
            parts, each_KN = parts[:4], parts[4]
            self._add_per_teacher(each_KN.sum(1), torch.full_like(each_KN[:, 0], each_KN.shape[1]))
        if self.crosstok is not None:  # no entropy: the cross-tokenizer loss never forms all token rows
            div_sum, per_token_N, token_logp_N = parts
            parts = (div_sum, per_token_N, torch.zeros_like(per_token_N), token_logp_N)
        out = DivergenceOutput(*parts)
        if num_items_in_batch is not None:
            n = num_items_in_batch
        else:  # the micro-batch's own completion tokens, or groups with the cross-tokenizer loss
            n = (comp_BC.sum() if self.crosstok is None else inputs["crosstok_groups"]).clamp(min=1)
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
        if self.teacher_set is not None and self.weighted is None and "teacher_id" in inputs:
            # routed: each token's divergence is its row's teacher's
            owner_B = torch.tensor(
                [self.teacher_ids.index(t) for t in inputs["teacher_id"]], device=ids_BT.device
            )
            owner_N = torch.repeat_interleave(owner_B, pred_BT.sum(1))
            onehot_KN = owner_N[None, :] == torch.arange(len(self.teacher_ids), device=ids_BT.device)[:, None]
            self._add_per_teacher(
                (onehot_KN * out.per_token_N[None, :]).sum(1), onehot_KN.sum(1).to(out.per_token_N.dtype)
            )
        self._keep_samples(inputs, pred_BT, out.per_token_N)
        return (loss, out) if return_outputs else loss

    def _add_per_teacher(self, sums_K: torch.Tensor, tokens_K: torch.Tensor) -> None:
        if self.stats.per_teacher is None:
            self.stats.per_teacher = torch.zeros(2 * len(self.teacher_ids), device=sums_K.device)
        self.stats.per_teacher = self.stats.per_teacher + torch.cat([sums_K.detach(), tokens_K]).to(
            self.stats.per_teacher
        )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """`Trainer.train`, with several teachers their fingerprints first: saved beside the checkpoints
        (`TEACHER_SET_FILE`) when the run starts, compared when it resumes (another set: one
        `mixture.TeacherSetMismatch` line, before any step)."""
        if self.teacher_set is not None:
            self._check_teacher_set(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _check_teacher_set(self, resume_from_checkpoint) -> None:
        path = Path(self.args.output_dir) / TEACHER_SET_FILE
        probe = self.processing_class(served.PROBE_TEXT, add_special_tokens=False)["input_ids"]
        now = mixture.fingerprints(self.teacher_set, probe)
        dtypes = [getattr(t, "served_dtype", "float32") for t in self.teacher_set.values()]
        dtypes += ["bfloat16"] if self.args.bf16 else []
        tolerance = max(served.FINGERPRINT_TOLERANCE.get(d, 0.1) for d in dtypes)
        if resume_from_checkpoint and path.exists():
            mixture.check_same_teachers(json.loads(path.read_text()), now, tolerance)
        elif self.args.process_index == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, json.dumps(now, indent=1))

    def _teacher_part(self, pred_BT: torch.Tensor, **fwd) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's final hidden states where `pred_BT` marks a predicted token, and its head weight:
        run as the teacher's forward, the only place a sharded teacher's head is whole. The divergence
        reads that head again in the student's backward (it recomputes each chunk's logits) after FSDP
        has freed the gathered weight, so a sharded teacher hands over a copy: one head per micro-batch,
        held until its backward, instead of a replicated teacher."""
        t_hidden_NH = self.teacher.base_model(**fwd).last_hidden_state[pred_BT]
        head_VH = self.teacher.get_output_embeddings().weight
        return t_hidden_NH, head_VH.detach().clone() if self.teacher_sharded else head_VH

    @torch.no_grad()
    def _check_teacher(self, t_hidden_NH, t_head_VH, fwd: dict, pred_BT) -> None:
        """`teacher_logprob_gap`: the mean |log p_served - log p_reference| of the completion tokens the
        teacher reads (the student's, or with another tokenizer its own), the served states x this run's head
        against the teacher in this process (`ServedTeacher.reference`), over the micro-batch summed across
        processes; past `served.FINGERPRINT_TOLERANCE` of the server's dtype the run stops
        (`served.ServedTeacherMismatch`, one line) before the step's update."""
        ref = self.teacher_reference
        target_N = fwd["input_ids"][:, 1:][pred_BT[:, :-1]]
        r_hidden_NH = ref.base_model(**fwd).last_hidden_state[pred_BT]
        r_head_VH = ref.get_output_embeddings().weight
        V = self.teacher_vocab_size
        gaps = []
        for s in range(0, target_N.shape[0], self.args.loss_chunk_size):
            rows, tgt = (
                slice(s, s + self.args.loss_chunk_size),
                target_N[s : s + self.args.loss_chunk_size, None],
            )
            lp = [
                torch.log_softmax(h[rows].float() @ w[:V].float().T, -1).gather(1, tgt).squeeze(1)
                for h, w in ((t_hidden_NH, t_head_VH), (r_hidden_NH, r_head_VH))
            ]
            gaps.append((lp[0] - lp[1]).abs())
        gap_N = torch.cat(gaps) if gaps else t_hidden_NH.new_zeros(0)
        self.stats.teacher_gap_sum += gap_N.sum().double()
        self.stats.teacher_gap_tokens += gap_N.shape[0]
        sums = torch.stack([gap_N.sum().double(), torch.tensor(float(gap_N.shape[0]), device=gap_N.device)])
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        gap = float(sums[0] / sums[1].clamp(min=1))
        dtype = getattr(self.teacher, "served_dtype", "float32")
        tolerance = served.FINGERPRINT_TOLERANCE.get(dtype, 0.1)
        if not gap <= tolerance:
            raise served.ServedTeacherMismatch(
                f"teacher_logprob_gap {gap:.3g} at step {self.state.global_step + 1} (tolerance "
                f"{tolerance:g} for a {dtype} server): the served states times this run's teacher head "
                "give other log-probabilities of the sampled tokens than the teacher in this process; the "
                "server serves another model than teacher_model, or the head is not its own. Stopped before "
                "the update."
            )

    def _check_sync(self, gap_N: torch.Tensor) -> None:
        """The one host read before a backward pass (first steps only): every rank stops together if the
        micro-batch's gap, summed over all processes, is off."""
        sums = torch.stack([gap_N.sum(), torch.tensor(float(gap_N.shape[0]), device=gap_N.device)]).double()
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        engines.check_sync(*sums.tolist(), dtype=self._engine.dtype, step=self.state.global_step + 1)

    def _keep_samples(self, inputs, pred_BT, per_token_N) -> None:
        """Keep the rows sampled first in the step (micro-batches are grouped by length, so these are a
        fair draw, not the shortest) as device tensors; `_sample_records` reads them at logging time."""
        step = self.state.global_step + 1
        per_log = self.args.samples_per_log
        if not (self.run and self.args.sample_every and step % self.args.sample_every == 0):
            return
        rows_B = inputs["input_ids"].shape[0]
        sampled_as = inputs["sampled_as"]
        keep = [b for b in range(rows_B) if sampled_as[b] < per_log]
        if not keep:
            return
        keys = ("input_ids", "attention_mask", "completion_mask_BC")
        self._step_samples.append(
            {
                "step": step,
                "keep": keep,
                "sampled_as": [sampled_as[b] for b in keep],
                **{k: inputs[k].detach() for k in keys},
                "pred_BT": pred_BT,
                "per_token_N": per_token_N,  # every row's predicted positions, row after row
                "answers": inputs.get("answers") or [None] * rows_B,
            }
        )

    def _sample_records(self) -> list[dict]:
        """The kept samples as samples.jsonl records in sampling order, one host copy per kept micro-batch."""
        tok, records = self.processing_class, []
        for s in self._step_samples:
            ids_BT, attn_BT, comp_BC = (
                s[k].cpu() for k in ("input_ids", "attention_mask", "completion_mask_BC")
            )
            counts = s["pred_BT"].sum(1).cpu().tolist()
            divs = s["per_token_N"].cpu().split(counts)
            prompt_len = ids_BT.shape[1] - comp_BC.shape[1]
            for b, place in zip(s["keep"], s["sampled_as"]):
                prompt = ids_BT[b, :prompt_len][attn_BT[b, :prompt_len].bool()]
                comp = ids_BT[b, prompt_len:][comp_BC[b].bool()]
                record = {
                    "step": s["step"],
                    "prompt": tok.decode(prompt),
                    "tokens": tok.convert_ids_to_tokens(comp.tolist()),
                    "divergence": [round(d, 5) for d in divs[b].tolist()],
                    "answer": s["answers"][b],
                }
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
            self.run.log({"step": self.state.global_step, "eval_accuracy": logs["eval_accuracy"]})
        super().log(logs, start_time)

    def _step_metrics(self, logs: dict) -> dict:
        sums = self.stats.as_tensor(self.args.device)
        if self.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(sums)
        seqs, toks, trunc, ent, gap, gap_toks, t_gap, t_gap_toks = sums[:8].tolist()
        n_teachers = len(self.teacher_ids)
        per_teacher = sums[8:].tolist() if self.stats.per_teacher is not None else [0.0] * (2 * n_teachers)
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
            "entropy": ent / max(toks, 1) if self.crosstok is None else None,
            "tokens_per_s": toks / elapsed,
            "completion_tokens": toks,
            # Mean |log p_engine - log p_student| of the sampled tokens: a stale or wrong weight sync
            # shows here.
            "engine_logprob_gap": gap / gap_toks if gap_toks else None,
        }
        for tid, div, n in zip(self.teacher_ids, per_teacher[:n_teachers], per_teacher[n_teachers:]):
            record[f"divergence/{tid}"] = div / n if n else None  # mean per token over its rows
        if self.teacher_reference is not None:  # a served teacher against its reference, first steps only
            record["teacher_logprob_gap"] = t_gap / t_gap_toks if t_gap_toks else None
        if self.topk is not None:  # the loss is not the divergence: say so beside it
            record["teacher_logprobs"] = f"topk:{self.topk.k} (approximate)"
        if self.run and self.args.process_index == 0:
            self.run.log(record)
            for s in self._sample_records():
                self.run.log(s, "samples.jsonl")
        self._step_samples = []
        return {k: v for k, v in record.items() if k not in ("step", "loss", "grad_norm")}


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
        models = {"student": trainer.model, "teacher": trainer.teacher}
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
