"""Every settings group, declared once, torch-free: a job's config composes them (`jobs/<job>/config.py`), the
trainer's `opd.arguments.OPDArguments` mixes in `OPDSettings`, and the command line reads, checks and lists
them (`run.cli`) without importing torch or transformers, so a misspelt setting is answered in about a second.
Each group's docstring names the code that reads it; that module imports the group from here.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from typing import Any

from opdkit.config import ConfigError, name_list, setting

ADS_METHODS = ("fd", "jvp")  # ads.direction: finite difference, or torch.func.jvp
ENVIRONMENTS = ("calculator",)  # multi-turn tool environments (opdkit.tasks.ENVIRONMENTS builds them)


# The models a job loads (opdkit/models.py loads them).
@dataclass
class TeacherSettings:
    """The teacher whose distribution is distilled (or whose traces are learnt from)."""

    teacher_model: str = setting(
        "tiny:teacher",
        "the teacher: a local Hugging Face folder, a hub name, or tiny:teacher; 02, 03 and 04's on-policy "
        "attackers need it to share the student's tokenizer",
    )


@dataclass
class StudentSettings:
    """The student that is distilled."""

    student_model: str = setting(
        "tiny:student", "the student distilled: a local Hugging Face folder, a hub name, or tiny:student"
    )


@dataclass
class ProxySettings:
    """The proxy student of antidistillation sampling (01, 04)."""

    proxy_model: str = setting(
        "tiny:student",
        "the proxy student whose gradient steers ADS (shares the teacher's tokenizer): folder, hub name, or "
        "tiny:student",
    )


@dataclass
class PrecisionSettings:
    """The models' precision on a GPU."""

    bf16: bool = setting(
        False,
        "on a GPU: bf16 weights for the frozen models (teacher; never the proxies, always fp32) and bf16 "
        "mixed precision for the trained students",
    )


@dataclass
class CheckpointingSettings:
    """Activation checkpointing of the trained models."""

    gradient_checkpointing: bool = setting(
        False, "recompute the trained models' activations in backward to save memory"
    )


# The gradient variants (opdkit/ads/tokenkinds.py reads them; savegrad computes the variant, 04 passes it on).
GRAD_TOKENS = ("all", "confident", "answer")


@dataclass
class GradientTokenSettings:
    """Which completion tokens the proxy's saved gradient is taken on (01; 04 passes them to the savegrad run
    it starts, and checks a given grads_run against them)."""

    grad_tokens: str = setting(
        "all",
        "the completion tokens the proxy's gradient is taken on: all; confident, every token but those where "
        "the teacher hesitates (entropy above grad_entropy, answer tokens always kept); answer, the final "
        "answer's tokens only",
        choices=GRAD_TOKENS,
    )
    grad_entropy: float = setting(
        0.3,
        "grad_tokens confident: nats of teacher entropy above which a completion token outside the answer is "
        "left out",
        min=0.0,
    )


# Sampling: the rollout engines (opdkit/rollout/engines.py), the teacher's traces.
ENGINES = ("hf", "vllm")


@dataclass
class EngineSettings:
    """The settings of whatever samples a job's completions (02's student rollouts, 01's teacher traces, 04's
    traces and its attackers' rollouts); declared once, mixed into the configs and `OPDArguments`. How long
    a completion may be is the rollouts' setting (`rollout_max_new_tokens`) or the traces'
    (`trace_max_new_tokens`)."""

    rollout_engine: str = setting(
        "hf",
        "what samples the completions, all of a step's prompts in one call: hf, the kit's KV-cached loop; "
        "vllm, a vLLM engine colocated in every process (install the vllm extra; with rollout_ahead, in the "
        "producer process), synced with the student once per optimizer step",
        choices=ENGINES,
    )
    vllm_gpu_memory_utilization: float = setting(
        0.3,
        "rollout_engine vllm: share of each GPU's memory the engine reserves for weights and KV cache, "
        "beside the training (on CPU: the share of RAM given to its KV cache)",
        min=0.01,
        max=1.0,
    )


@dataclass
class TraceSettings:
    """How a teacher writes traces for others to learn from (01's holdout traces, 04's traces at every
    point)."""

    trace_max_new_tokens: int = setting(1024, "tokens a teacher's trace may have at most", min=1)
    trace_batch_size: int = setting(
        64,
        "prompts per generation batch of the teacher's traces, per process; 0 means the largest that fits "
        "the memory plan (the kit's loop)",
        min=0,
    )
    trace_top_p: float = setting(
        1.0,
        "nucleus of the teacher's trace sampling (after 04's ADS term and temperature)",
        min=1e-3,
        max=1.0,
    )


# Prompts (opdkit/data/prompts.py).
@dataclass
class PromptSettings:
    """Which prompts a job reads and how they are rendered."""

    dataset_path: str = setting(
        "tiny",
        "prompts: tiny (the tiny world's task), a parquet/jsonl/json/arrow file, a saved datasets folder, or "
        "a "
        "hub name",
    )
    dataset_split: str = setting("train", "split to read from a datasets folder or hub dataset")
    subset_size: int = setting(
        1000, "prompts used, the first of the dataset's shuffle by seed; -1 means all", min=-1
    )
    max_prompt_length: int = setting(1024, "longer prompts are dropped (and counted)", min=1)
    enable_thinking: bool = setting(False, "passed to the chat templates (Qwen3 thinking mode)")
    system_prompt: str = setting("", "system message put before every prompt; empty for none")


# Evaluation (opdkit/tasks/evaluate.py).
@dataclass
class EvalSettings:
    """How a job measures greedy accuracy on held-out problems (`accuracy`)."""

    eval_size: int = setting(
        500,
        "held-out problems each accuracy is measured on; -1: all of the evaluation set (04's "
        "eval_dataset_path; 02 cuts its own from its data, so has no 'all'), 0: none, no accuracy measured "
        "(02; 04's finding is the students' accuracy, so needs some)",
        min=-1,
    )
    eval_max_new_tokens: int = setting(
        0,
        "completion budget when evaluating; 0 means that of what the students learned from: "
        "trace_max_new_tokens (04), rollout_max_new_tokens (02)",
        min=0,
    )
    eval_batch_size: int = setting(
        64, "prompts per greedy evaluation batch per process (KV cache memory)", min=1
    )
    forced_accuracy: bool = setting(
        False,
        "also measure accuracy with each final answer forced, as the ADS reference reports beside raw "
        "accuracy: the task's answer cue appended to each completion, a few greedy tokens more",
    )


# A teacher with another tokenizer (opdkit/opd/teachers/cross/).
@dataclass
class CrossTokenizerSettings:
    """GOLD's knobs for a teacher with another tokenizer (mixed into a job's config like `OPDSettings`)."""

    crosstok_align: str = setting(
        "bytes",
        "how the two tokenizations are paired: bytes (groups close where both sides' byte ends coincide; "
        "byte-level BPE or character tokenizers) or positional (token k with token k, ULD's fallback)",
        choices=("bytes", "positional"),
    )
    crosstok_merge: str = setting(
        "bayesian",
        "how a group of several tokens becomes one distribution: bayesian (the last token's distribution "
        "times the actual earlier tokens' probabilities), observed (the first token's distribution times "
        "the actual later tokens' probabilities), observed-trl (TRL's observed, one position late)",
        choices=("bayesian", "observed", "observed-trl"),
    )
    crosstok_hybrid: bool = setting(
        False,
        "generalized JSD (the kit's beta) on the vocabulary both tokenizers share, sorted L1 on the rest; "
        "off: sorted L1 (ULD) on the whole vocabularies",
    )
    crosstok_hybrid_weights: str = setting(
        "adaptive",
        "hybrid: adaptive (matched part weighted by the share of the teacher's vocabulary that matched, "
        "the rest by one minus it) or fixed (crosstok_matched_weight, crosstok_unmatched_weight)",
        choices=("adaptive", "fixed"),
    )
    crosstok_matched_weight: float = setting(
        0.5, "hybrid, fixed weights: weight of the matched part", min=0.0
    )
    crosstok_unmatched_weight: float = setting(
        0.5, "hybrid, fixed weights: weight of the unmatched part", min=0.0
    )
    crosstok_student_temperature: float = setting(
        1.0, "temperature of the student's distributions in the cross-tokenizer loss", min=1e-3
    )
    crosstok_teacher_temperature: float = setting(
        1.0, "temperature of the teacher's distributions in the cross-tokenizer loss", min=1e-3
    )
    crosstok_match: str = setting(
        "strings",
        "hybrid: the tokens both vocabularies share: strings (the same token string, as GOLD) or bytes (the "
        "same bytes, special tokens by string: a character tokenizer's newline and byte-level BPE's 'Ċ')",
        choices=("strings", "bytes"),
    )
    crosstok_skip_student_eos: bool = setting(True, "leave the student's trailing EOS out of the loss")
    crosstok_skip_teacher_eos: bool = setting(True, "leave the teacher's trailing EOS out of the loss")


# On-policy distillation (opdkit/opd/arguments.py, its OPDArguments mix OPDSettings in).
@dataclass
class OPDSettings(EngineSettings, CrossTokenizerSettings):
    """The distillation's own settings: the divergence, the student's sampling, what is logged; with a
    teacher whose tokenizer differs from the student's, the cross-tokenizer loss's (`crosstok_*`)."""

    beta: float = setting(
        1.0, "generalized JSD weight: 0 forward KL, 1 reverse KL(student||teacher)", min=0.0, max=1.0
    )
    kl_temperature: float = setting(1.0, "temperature both distributions are compared at", min=1e-3)
    rollout_max_new_tokens: int = setting(1024, "tokens a student's rollout may have at most", min=1)
    rollout_temperature: float = setting(1.0, "sampling temperature of the student's rollouts", min=1e-3)
    rollout_top_p: float = setting(
        1.0, "nucleus of the student's rollouts; 1.0 samples the full distribution", min=1e-3, max=1.0
    )
    rollout_ahead: int = setting(
        0,
        "steps the rollouts are sampled ahead of training, in a producer process of their own through "
        "rollout_engine (the kit's loop on a copy of the student, or a vLLM engine of its own), sent the "
        "student's weights after every optimizer step; 0 samples each step's rollouts in the step "
        "(synchronous)",
        min=0,
    )
    rollout_device: str = setting(
        "",
        "rollout_ahead >= 1: the producer's device: cuda:N (a GPU of its own beside the trainer's cuda:0), "
        "cpu, or empty: the trainer's device",
    )
    environment: str = setting(
        "",
        "multi-turn rollouts: each prompt an episode against this tool environment (opdkit/tasks/), the "
        "student's turns scored, the tools' results context only: calculator; empty: single-turn rollouts",
        choices=("", *ENVIRONMENTS),
    )
    max_turns: int = setting(
        4, "environment: the student's turns per episode at most, each up to rollout_max_new_tokens", min=1
    )
    episode_max_tokens: int = setting(
        0,
        "environment: tokens after the prompt per episode at most (the student's turns, the template's and "
        "the tools' tokens); an episode past it ends unfinished; 0: only max_turns limits it",
        min=0,
    )
    async_correction: str = setting(
        "none",
        "rollout_ahead >= 1: none trains on the stale rollouts as they are; truncated weights each token's "
        "divergence by min(pi_student / pi_sampler, async_ratio_cap), the sampler's log-probs its own",
        choices=("none", "truncated"),
    )
    async_ratio_cap: float = setting(
        2.0, "async_correction truncated: the largest importance weight a token gets", min=1.0
    )
    loss_chunk_size: int = setting(1024, "completion tokens per chunk of the divergence", min=1)
    sample_every: int = setting(
        10, "write a few sampled completions to samples.jsonl every this many steps; 0 never", min=0
    )
    samples_per_log: int = setting(4, "completions written each time", min=1)
    save_rollouts: bool = setting(
        False, "keep every step's prompts and completions in rollouts/ (token ids, per process)"
    )
    vllm_sleep: bool = setting(
        False,
        "rollout_engine vllm: free the engine's GPU memory (weights and KV cache, vLLM sleep level 2) "
        "between rollouts, for the training's forward and backward; the next weight sync brings it back. "
        "CUDA only",
    )

    def episode_tokens(self) -> int:
        """The most tokens a rollout holds after its prompt: a single-turn completion, or a multi-turn episode
        at its longest (`episode_max_tokens`, else `max_turns` turns of `rollout_max_new_tokens`; the tools'
        results between them are not counted there)."""
        if not self.environment:
            return self.rollout_max_new_tokens
        return self.episode_max_tokens or self.max_turns * self.rollout_max_new_tokens

    def normalise(self) -> None:
        """Run by whatever composes this group (a job's config, `opd.arguments.OPDArguments`): what sampling
        ahead and its correction need of the settings alone, before anything is loaded (the producer samples
        through either engine, single-turn completions or a multi-turn environment's episodes). What they need
        of the machine and the run is checked by `rollout.ahead.check_settings`."""
        if self.vllm_sleep and self.rollout_ahead:
            raise ConfigError(
                "vllm_sleep frees the engine's memory between rollouts for training in the same process; "
                f"with rollout_ahead={self.rollout_ahead} the engine samples in its own process while the "
                "trainer trains: set vllm_sleep false, or rollout_ahead 0."
            )
        if self.rollout_device and not re.fullmatch(r"cpu|cuda(:\d+)?", self.rollout_device):
            raise ConfigError(
                f"rollout_device={self.rollout_device!r} is not a device: give cuda:N (e.g. cuda:1), cpu, or "
                "empty for the trainer's device."
            )
        if self.rollout_device and not self.rollout_ahead:
            raise ConfigError(
                f"rollout_device={self.rollout_device} places the producer of rollout_ahead >= 1, and "
                "rollout_ahead is 0: set rollout_ahead >= 1, or leave rollout_device empty."
            )
        if self.async_correction != "none" and not self.rollout_ahead:
            raise ConfigError(
                f"async_correction={self.async_correction} corrects rollouts sampled ahead by older weights, "
                "and rollout_ahead is 0: set rollout_ahead >= 1, or async_correction none."
            )


@dataclass
class EngineContextSettings:
    """What a job derives for its trainer's vLLM engine from its own lengths (`opd.arguments.OPDArguments`
    mixes it in; no job's config does: each sets it from its prompt and completion budgets)."""

    vllm_max_model_len: int = setting(
        0, "vllm: longest prompt plus completion; 0 means the model's own limit", min=0
    )


@dataclass
class OPDTraining:
    """How on-policy distillation trains, under TrainingArguments' own names where they mean the same
    (`training_arguments` maps them; `checkpoint_every` is its `save_steps`, 0 meaning at the end only)."""

    learning_rate: float = setting(1e-6, "peak learning rate (AdamW)", min=0.0)
    lr_scheduler_type: str = setting("constant", "transformers scheduler name: constant, linear, cosine, ...")
    warmup_ratio: float = setting(0.0, "fraction of steps spent warming up", min=0.0, max=0.999)
    optim: str = setting(
        "adamw_torch_fused",
        "optimizer, a transformers `optim` name: adamw_torch_fused (TrainingArguments default, the "
        "original), sgd, ...",
    )
    optim_args: str = setting("", "extra optimizer arguments, e.g. momentum=0.9 for sgd")
    weight_decay: float = setting(0.0, "AdamW weight decay", min=0.0)
    adam_beta2: float = setting(0.999, "AdamW beta2", min=0.0, max=1.0)
    per_device_train_batch_size: int = setting(4, "prompts per process per micro-batch", min=1)
    global_batch_size: int = setting(
        0,
        "prompts per optimizer step over all processes, whatever their number; the micro-batches each "
        "process accumulates are derived: global_batch_size / (per_device_train_batch_size x processes). "
        "0 means one micro-batch per process",
        min=0,
    )
    num_train_epochs: float = setting(1.0, "passes over the prompts (ignored when max_steps > 0)", min=0.0)
    max_steps: int = setting(-1, "optimizer steps; -1 means num_train_epochs", min=-1)
    max_grad_norm: float = setting(
        1.0, "clip the global gradient norm to this; 0 turns clipping off", min=0.0
    )
    parallelism: str = setting(
        "ddp",
        "how several processes hold the models: ddp replicates them; fsdp shards the student with FSDP2 "
        "(accelerate) and the frozen teacher too (weights only), for models too big to replicate; one "
        "process ignores it",
        choices=("ddp", "fsdp"),
    )
    logging_steps: int = setting(1, "log metrics every this many optimizer steps", min=1)
    checkpoint_every: int = setting(
        100,
        "checkpoint every this many optimizer steps, and at the end (a resume continues from the newest); 0: "
        "at the end only",
        min=0,
    )
    save_total_limit: int = setting(2, "checkpoints kept", min=1)

    def accumulation_steps(self, processes: int) -> int:
        """Micro-batches each process accumulates per optimizer step, so that a step takes
        `global_batch_size` prompts over `processes` processes."""
        per_device, total = self.per_device_train_batch_size, self.global_batch_size
        if not total:
            return 1
        if total % (per_device * processes):
            fits = [n for n in range(1, per_device + 1) if total % (n * processes) == 0]
            hint = f" or per_device_train_batch_size={max(fits)}," if fits else ""
            raise ConfigError(
                f"global_batch_size={total} prompts per optimizer step do not split into micro-batches of "
                f"per_device_train_batch_size={per_device} on {processes} process(es), "
                f"{per_device * processes} prompts a round; set global_batch_size to a multiple of "
                f"{per_device * processes},{hint} or change the number of processes (num_processes)."
            )
        return total // (per_device * processes)


# A served teacher (opdkit/opd/teachers/served/).
@dataclass
class ServedSettings:
    """A teacher served elsewhere (02): its final hidden states from a vLLM pooling server, its head here."""

    teacher_server: str = setting(
        "",
        "URL of a vLLM pooling server serving teacher_model's final hidden states (README: A teacher on "
        "other GPUs or another node): the training processes load only the teacher's head; local: the run "
        "starts that server on teacher_gpus and stops it when it ends; empty: every training process loads "
        "the whole teacher",
    )
    teacher_gpus: str = setting(
        "",
        "teacher_server local: the visible GPUs (comma-separated indices) its server runs on, tensor "
        "parallel across them; the training runs on the other visible GPUs",
    )
    teacher_server_dtype: str = setting(
        "bfloat16",
        "teacher_server: the dtype the server computes in (its --dtype), which the states also travel in",
        choices=("float32", "bfloat16", "float16"),
    )
    teacher_server_reference: bool = setting(
        False,
        "teacher_server: also load teacher_model whole in each training process and compare the served "
        "states x head with it on the first 2 steps (teacher_logprob_gap; the run stops past the server "
        "dtype's tolerance): to validate a setup where the teacher fits (the start checks cannot see a "
        "wrong head)",
    )
    teacher_logprobs: str = setting(
        "exact",
        "how the teacher's distribution reaches the loss: exact, every logit (the teacher in process, or "
        "teacher_server's final hidden states times its head); topk:K, the teacher's K most likely tokens' "
        "log-probabilities from teacher_server as an ordinary vLLM generation server (`vllm serve`, "
        "--max-logprobs >= K): an APPROXIMATE divergence (the rest of the vocabulary is one bin; it "
        "under-states the exact one), kl_temperature 1 only",
    )

    def normalise(self) -> None:
        """Run by the config that composes this group: `teacher_logprobs` parses, and topk:K has a server and
        compares at temperature 1."""
        try:
            k = parse_topk(self.teacher_logprobs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if k is None:
            return
        if not self.teacher_server:
            raise ConfigError(
                f"teacher_logprobs={self.teacher_logprobs} reads the teacher's top-K log-probabilities from "
                "a vLLM generation server: set teacher_server to its URL (or local), or use teacher_logprobs "
                "exact."
            )
        temperature = getattr(self, "kl_temperature", 1.0)
        if temperature != 1.0:
            raise ConfigError(
                f"teacher_logprobs={self.teacher_logprobs} at kl_temperature={temperature}: the served "
                "log-probabilities are at temperature 1 and the teacher's tail mass at another cannot be "
                "known from them; set kl_temperature 1, or teacher_logprobs exact."
            )

    def topk(self) -> int | None:
        """K of `teacher_logprobs` topk:K; None when exact."""
        return parse_topk(self.teacher_logprobs)


def parse_topk(spec: str) -> int | None:
    """`exact` -> None, `topk:K` -> K (a positive integer); anything else is refused."""
    if spec == "exact":
        return None
    if spec.startswith("topk:") and spec[5:].isdigit() and int(spec[5:]) > 0:
        return int(spec[5:])
    raise ValueError(f"teacher_logprobs={spec!r}: expected exact, or topk:K with K a positive integer")


# A defended teacher (opdkit/opd/teachers/defended.py).
DEFENCES = ("none", "topk", "sampled", "round", "noise")  # the kinds `teacher_defence` names


@dataclass
class DefenceSettings:
    """What a teacher's API returns in place of its log-probabilities, transformed before the student's loss
    sees it (02's in-process teacher; 04 runs a list of them, `defences`)."""

    teacher_defence: str = setting(
        "none",
        "what the teacher returns to the student's loss: none (its whole distribution); topk:K (its K most "
        "likely tokens' log-probabilities and the scored token's, the rest one bin); sampled (the scored "
        "token's log-probability alone: the per-token log-ratio loss); round:D (every log-probability "
        "rounded to D decimals, renormalised by the student); noise:S (Gaussian noise of scale S nats on "
        "every log-probability, renormalised); kl_temperature 1, a teacher in process",
    )

    def normalise(self) -> None:
        """Run by the config that composes this group: the defence parses; it needs kl_temperature 1 and a
        single teacher in process."""
        try:
            parse_defence(self.teacher_defence)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.teacher_defence == "none":
            return
        temperature = getattr(self, "kl_temperature", 1.0)
        if temperature != 1.0:
            raise ConfigError(
                f"teacher_defence={self.teacher_defence} at kl_temperature={temperature}: the teacher serves "
                "log-probabilities at temperature 1; set kl_temperature 1, or teacher_defence none."
            )
        if getattr(self, "teacher_server", "") or getattr(self, "teachers", ""):
            raise ConfigError(
                f"teacher_defence={self.teacher_defence} transforms the scores of one teacher in this "
                "process; leave teacher_server and teachers empty, or set teacher_defence none."
            )


def parse_defence(spec: str) -> tuple[str, float | None]:
    """`none` -> ("none", None), `topk:K` -> ("topk", K), `sampled`, `round:D` (D decimals, an integer >= 0),
    `noise:S` (S > 0 nats); anything else is refused in one line, naming the closest kind."""
    kind, _, value = str(spec).partition(":")
    wants = {"none": "", "sampled": "", "topk": "K", "round": "D", "noise": "S"}
    grammar = "none, topk:K, sampled, round:D or noise:S"
    if kind not in wants:
        close = difflib.get_close_matches(kind, DEFENCES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ValueError(f"teacher_defence={spec!r} is not a defence: {hint}expected {grammar}.")
    if bool(value) != bool(wants[kind]):
        form = f"{kind}:{wants[kind]}" if wants[kind] else kind
        raise ValueError(f"teacher_defence={spec!r}: {kind} is written {form} (one of {grammar}).")
    if not wants[kind]:
        return kind, None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    low = {"topk": 1, "round": 0}.get(kind)
    fits = number > 0 if low is None else number.is_integer() and number >= low
    if not fits:
        need = {"topk": "a positive integer", "round": "an integer >= 0", "noise": "a positive number"}[kind]
        raise ValueError(
            f"teacher_defence={spec!r}: {wants[kind]} must be {need}, e.g. {kind}:{_EXAMPLE[kind]}."
        )
    return kind, number if low is None else int(number)


_EXAMPLE = {"topk": "20", "round": "1", "noise": "0.5"}


# Several teachers (opdkit/opd/teachers/sets.py).
@dataclass(frozen=True)
class TeacherSpec:
    """One teacher of `teachers`: its id, the model (its head and tokenizer, or the whole teacher), and the
    URL of a pooling server serving its states ("" when it runs in the training process)."""

    id: str
    model: str
    server: str = ""


@dataclass
class TeacherSetSettings:
    """Several teachers (02): each row scored by the teacher its `teacher_id` column names, or every row by
    all of them (`teacher_weights`)."""

    teachers: str = setting(
        "",
        "several teachers instead of teacher_model: id=model, comma-separated (a YAML list of {id, model, "
        "server} too); id=model@http://host:port takes that teacher's states from a vLLM pooling server "
        "serving model (its head is read from model). Rows are scored by the teacher their teacher_id "
        "column names, or by all with teacher_weights; each teacher's divergence is logged as "
        "divergence/<id>; a resume with another set is refused. Empty: the one teacher_model",
    )
    teacher_weights: str = setting(
        "",
        "with teachers: id=weight, comma-separated: every row scored by every teacher, the loss "
        "sum_k w_k D(student, teacher_k) (not the divergence to a mixed teacher); empty: routed by the "
        "data's teacher_id column",
    )

    def normalise(self) -> None:
        """Run by the config that composes this group: both settings parse, the weights name the teachers."""
        specs, weights = self.teacher_specs(), self.weights()
        if weights and not specs:
            raise ConfigError("teacher_weights is set without teachers: name the teachers (id=model,...).")
        if weights and set(weights) != {t.id for t in specs}:
            raise ConfigError(
                f"teacher_weights names {sorted(weights)} but teachers are {sorted(t.id for t in specs)}; "
                "give one weight per teacher id."
            )
        if specs and getattr(self, "teacher_server", ""):
            raise ConfigError(
                "teachers and teacher_server are both set: give each served teacher its server inside "
                "teachers (id=model@http://host:port), and leave teacher_server empty."
            )

    def teacher_specs(self) -> list[TeacherSpec]:
        return parse_teachers(self.teachers)

    def weights(self) -> dict[str, float]:
        return parse_weights(self.teacher_weights)


def parse_teachers(value: Any) -> list[TeacherSpec]:
    """`teachers` as specs: "id=model[@url],..." or a list of {id, model, server} (YAML, papermill)."""
    if not value:
        return []
    items = value if isinstance(value, list) else [v for v in str(value).split(",") if v.strip()]
    specs = []
    for item in items:
        if isinstance(item, dict) and item.get("id") and item.get("model"):
            specs.append(TeacherSpec(str(item["id"]), str(item["model"]), str(item.get("server") or "")))
            continue
        tid, eq, rest = str(item).strip().partition("=")
        model, at, server = rest.partition("@")
        if not (eq and tid.strip() and model.strip()) or (
            at and not server.startswith(("http://", "https://"))
        ):
            raise ConfigError(
                f"teachers: {item!r} is not id=model or id=model@http://host:port (e.g. "
                "math=Qwen/Qwen3-4B,code=Qwen/Qwen3-4B@http://node7:8000)."
            )
        specs.append(TeacherSpec(tid.strip(), model.strip(), server.strip()))
    ids = [t.id for t in specs]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"teachers: the ids {ids} repeat; give each teacher its own id.")
    return specs


def parse_weights(value: Any) -> dict[str, float]:
    """`teacher_weights` as {id: w}: "id=w,..." or a mapping; each w >= 0, not all 0."""
    if not value:
        return {}
    pairs = (
        value.items() if isinstance(value, dict) else [v.partition("=")[::2] for v in str(value).split(",")]
    )
    try:
        weights = {str(k).strip(): float(w) for k, w in pairs}
    except ValueError:
        raise ConfigError(
            f"teacher_weights={value!r}: give id=weight pairs, e.g. math=0.7,code=0.3"
        ) from None
    if any(not w >= 0 for w in weights.values()) or not sum(weights.values()) > 0:
        raise ConfigError(f"teacher_weights={value!r}: each weight >= 0, and not all 0")
    return weights


# Students distilled by SFT (opdkit/sft/student.py).
@dataclass
class SFTSettings:
    """How a student is distilled on traces by completion-only SFT, and what of it is kept."""

    student_init: str = setting(
        "pretrained",
        "pretrained: the student's weights; scratch: its architecture, freshly initialised by seed",
        choices=("pretrained", "scratch"),
    )
    sft_seed: int = setting(
        -1,
        "seed of the students' SFT order (and scratch initialisation); -1 means seed. The ADS "
        "reference distils with seed 69",
        min=-1,
    )
    sft_max_steps: int = setting(200, "optimizer steps of every student's SFT; -1 means sft_epochs", min=-1)
    sft_epochs: float = setting(3.0, "passes over the traces when sft_max_steps is -1", min=0.0)
    sft_batch_size: int = setting(64, "traces per optimizer step", min=1)
    sft_micro_batch_size: int = setting(
        0, "traces per forward pass (gradient accumulation); 0 means sft_batch_size", min=0
    )
    sft_learning_rate: float = setting(
        3e-3, "peak learning rate of the students' SFT (AdamW, warmup then cosine)", min=0.0
    )
    sft_weight_decay: float = setting(0.0, "AdamW weight decay of the students' SFT", min=0.0)
    sft_warmup_ratio: float = setting(0.05, "fraction of SFT steps spent warming up", min=0.0, max=0.999)
    sft_max_length: int = setting(
        0, "traces longer than this many student tokens are cut; 0 means no cap", min=0
    )
    student_lora_r: int = setting(
        0,
        "LoRA rank of the distilled students (peft: pip install 'opdkit[lora]'); 0 fine-tunes every weight",
        min=0,
    )
    student_lora_alpha: float = setting(
        0.0, "LoRA alpha (the adapter's scale is alpha / r); 0 means student_lora_r", min=0.0
    )
    student_lora_dropout: float = setting(0.0, "dropout on the LoRA adapters' inputs", min=0.0, max=1.0)
    student_lora_target_modules: list = setting(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "modules of the student that get a LoRA adapter (names, or [all-linear])",
    )
    student_save: str = setting(
        "adapter",
        "what of each distilled student is kept in its folder's student/: adapter (the LoRA adapter; without "
        "LoRA the whole model), merged (the model with the adapter merged in), none",
        choices=("adapter", "merged", "none"),
    )
    sft_checkpoint_every: int = setting(
        0, "checkpoint each student every this many SFT steps (resume continues from it); 0 never", min=0
    )

    def normalise(self) -> None:
        """Run by the config that composes this group (`RunFields.__post_init__`)."""
        self.student_lora_target_modules = name_list(
            "student_lora_target_modules", self.student_lora_target_modules
        )

    def sft_micro_batch(self) -> int:
        """Traces per forward pass."""
        return min(self.sft_micro_batch_size or self.sft_batch_size, self.sft_batch_size)
