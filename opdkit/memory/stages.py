"""What one process holds at once (`Stage`), and the per-token byte formulas its rows are made of: the KV
cache, training activations, a forward's working set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opdkit.memory.shapes import ModelShape, dtype_bytes, dtype_name


def kv_bytes_per_token(shape: ModelShape, dtype: Any, autocast: bool = False) -> int:
    """Keys and values of every layer for one token: layers x KV heads x head_dim x (K's + V's bytes).
    Both are in the weights' `dtype`, except under bf16 `autocast` where V is bf16 and K stays in the
    weights' dtype: the fp32 cos and sin of RoPE (and Qwen3's k_norm weight) promote K back to fp32."""
    k = dtype_bytes(dtype)
    v = min(k, 2) if autocast else k
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * (k + v)


def kv_dtypes(dtype: Any, autocast: bool = False) -> str:
    """The cache's dtypes as the plan says them: 'bfloat16', or 'K float32, V bfloat16' under autocast."""
    name = dtype_name(dtype)
    if autocast and dtype_bytes(name) > 2:
        return f"K {name}, V bfloat16"
    return name


def activation_bytes_per_token(
    shape: ModelShape, residual_bytes: int, compute_bytes: int, cast: bool, masked_len: int = 0
) -> int:
    """What autograd keeps per token in one decoder layer while training (SDPA attention), by count.

    r = `residual_bytes` (the trained weights' dtype), a = `compute_bytes` (2 under bf16 autocast); `cast`
    when autocast casts each projection's input anew (fp32 weights under bf16):
    - two RMSNorms on h: their fp32 input and normalised output, (4 + r) h each;
    - projection inputs: q, k, v, gate and up each keep their own cast (5 a h), or share the two norms'
      outputs (2 r h);
    - q/k RMSNorms (Qwen3): fp32 input and normalised output, (4 + a) per q and per k value;
    - SDPA: the rotated q and the output, 2 a per q value; k and v, 2 a per kv value, or per q value
      under a padding mask (`masked_len` > 0 columns: transformers repeats k and v to every query head),
      plus the mask, which SDPA keeps in the matmul dtype, a per column;
    - the MLP: gate, SiLU(gate), up and their product, 4 a per intermediate value;
    - fp32 statistics: the RMSNorms' 1 / rms (2, + heads + KV heads for q/k) and SDPA's log-sum-exp (heads).
    tests/test_memory.py checks it against `torch.autograd.graph.saved_tensors_hooks` on real layers.
    """
    h, a, r = shape.hidden_size, compute_bytes, residual_bytes
    qk = (4 + a) if shape.qk_norm else 0
    kv_kept = shape.q_dim if masked_len else shape.kv_dim
    return (
        h * (2 * (4 + r) + (5 * a if cast else 2 * r))
        + shape.q_dim * (2 * a + qk)
        + shape.kv_dim * qk
        + 2 * a * kv_kept
        + a * masked_len
        + 4 * a * shape.intermediate_size
        + 4 * (2 + shape.num_heads + (shape.num_heads + shape.num_kv_heads) * shape.qk_norm)
    )


def forward_working_bytes(shape: ModelShape, tokens: int, compute_bytes: int) -> int:
    """A no-grad forward's largest moment: one layer's residual, q, k, v, output, gate, up and their
    product alive together for `tokens` tokens."""
    width = 3 * shape.hidden_size + 2 * shape.q_dim + 2 * shape.kv_dim + 3 * shape.intermediate_size
    return tokens * compute_bytes * width


@dataclass(frozen=True)
class SetMemberShape:
    """A teacher of a set beyond its first (`Stage.other_teachers`): its shape, and whether it is served."""

    shape: ModelShape
    served: bool = False


# Texts whose token counts give `token_ratio`: prose, a word problem, LaTeX, digits, code and a worked step,
# the kinds of text a math run's prompts and completions hold.
TOKEN_SAMPLE = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
    "many clips did Natalia sell altogether in April and May?",
    "Let $f(x) = \\frac{3x^2 - 2x + 1}{\\sqrt{x + 4}}$. Compute $f'(0)$ and give the answer as \\boxed{m/n}.",
    "12+345=357\n9076+88=9164\n40000-1=39999\n0.125 * 64 = 8",
    "def gcd(a: int, b: int) -> int:\n    while b:\n        a, b = b, a % b\n    return a\n",
    "Step 1: 2^{10} = 1024, and 1024 mod 7 = 2 because 7 x 146 = 1022. Answer: 2",
    "The quick brown fox jumps over the lazy dog; naïve café, déjà vu — 東京 😀.",
)


def token_ratio(
    student_tokenizer: Any, teacher_tokenizer: Any, texts: tuple[str, ...] = TOKEN_SAMPLE
) -> float:
    """The most teacher tokens per student token over `texts` (each text tokenized by both, no special
    tokens), at least 1: a bound on how many more rows a teacher that cuts finer reads than the student
    (`Stage.teacher_token_ratio`); a teacher that cuts coarser is planned at the student's count. A text
    either tokenizer refuses (a character outside a closed vocabulary, as the tiny world's) is left out:
    neither model can be given it."""

    def count(tokenizer: Any, text: str) -> int | None:
        try:
            return len(tokenizer(text, add_special_tokens=False).input_ids)
        except Exception:  # tokenizers raises its own Exception type for an unknown character
            return None

    ratios = []
    for t in texts:
        teacher, student = count(teacher_tokenizer, t), count(student_tokenizer, t)
        if teacher is not None and student is not None:
            ratios.append(teacher / max(1, student))
    return max(1.0, *ratios)


@dataclass(frozen=True)
class Stage:
    """What one process holds at once, in plain numbers; leave a model None or a batch 0 where the stage
    has none. Batches are rows per process.

    student: the trained model (02/03's student; 01's proxy in its gradient pass, with optimizer "none").
    teacher: frozen; under fsdp sharded too when `shard_teacher` (issue 20, item 6), else replicated.
    proxy: ADS (04): the proxy and `proxy_gradients` loaded gradients (in CPU memory when
        `proxy_on_host`), and `ads_copies` perturbed copies (finite differences: 2), each with a KV cache
        when the teacher samples (`sampler` "teacher"); when they score a student's rollouts (`sampler`
        "student", with a teacher) no cache, but the ADS teacher's stacked fp32 head.
    bf16: autocast mixed precision for training, the kit's rollouts and evaluation. eval_bf16: evaluation's
        own when it differs (None: `bf16`; 04 evaluates its students in fp32). device: "cuda" or "cpu"
        (AdamW's temporaries, the CPU bf16 head copies). cpu_bf16_head_copies: whether a bf16 decoding
        loop on CPU copies the head per row (None: as this host's torch does, `cpu_bf16_head_copies`).
    optimizer: "adamw" (2 states), "sgd" (with momentum: 1), "none" (gradients only).
    sampler: whose decoding with the kit's loop fills the rollout KV cache, `sampled_rows` rows of
        prompt_len + completion_len tokens (02 samples every row of an optimizer step at once);
        with rollout_engine "vllm" the engine's share replaces it.
    eval_model, eval_batch_size: decoded with the kit's loop under autocast (0: no evaluation here).
    sync_streamed: the vLLM weight sync hands over one tensor at a time (as VLLMEngine.sync does).
    teacher_served: the teacher's final states come from a server (`teacher_server`, `opd.teachers.served`):
        the process holds its head (vocabulary x hidden, in `teacher_dtype`) and a micro-batch's states (a
        step's, received in `served_dtype`, wait in host memory), never its layers; it neither decodes nor
        is sharded here.
    gpu_memory_gb: the visible card's whole memory (vLLM reserves its share of that); 0: not known here, the
        share is taken of the plan's budget and the row says so.
    trainable_params: the student's parameters the optimizer updates, when not all of them (LoRA: the
        adapters, `ModelShape.lora_params`); gradients and optimizer state are theirs, the frozen weights
        have none. 0: every parameter trains.
    cross_tokenizer: the teacher has another tokenizer (`opd.teachers.cross`): the loss's chunks hold rows of
        both vocabularies, the student's and the teacher's own, and its backward pass returns the student
        head's gradient whole (vocabulary x hidden), beside `.grad` while micro-batches accumulate.
    teacher_token_ratio: the teacher's tokens per student token of the same text (a teacher with another
        tokenizer; `token_ratio`): the teacher's final states, and a served teacher's, are counted at the
        student's token counts times it.
    other_teachers: a teacher set (`teachers`) beyond its first (`teacher`, `teacher_served`): each one's
        weights in process (sharded as `teacher` is), or a served one's head and states; its final states
        beside the first's in training; `teachers_routed` (rows routed by `teacher_id`, no `teacher_weights`):
        the heads of all stacked side by side once (`opd.teachers.sets.RoutedTeacher`).
    eval_student: the student is evaluated too (02: before, during and after training, on the kit's loop
        under the run's autocast), in a phase of its own beside `eval_model`'s evaluation.
    rollout_ahead: the student's rollouts are sampled up to this many steps ahead by a producer process
        (`rollout.ahead`), never in this one: the producer holds a float32 copy of the student, on a GPU the
        state_dict it loads at each weight update, and its engine's sampling memory for `sampled_rows` rows
        (the kit's loop without autocast; vLLM: its share), all beside every phase of the trainer; its queue
        holds weight copies, rollouts and prompts in host memory (`components.producer_components`,
        `components.queue_components`).
    producer_place: where that producer lives: "beside" this process (the same device: its rows are this
        stage's), "gpu" (a GPU of its own: a plan of its own, `plans.producer_plans`), "cpu" (host memory).
    """

    student: ModelShape | None = None
    teacher: ModelShape | None = None
    proxy: ModelShape | None = None
    student_dtype: str = "float32"
    teacher_dtype: str = "bfloat16"
    proxy_dtype: str = "float32"
    bf16: bool = False  # as the `bf16` setting's default (`settings.PrecisionSettings`)
    device: str = "cuda"
    cpu_bf16_head_copies: bool | None = None
    optimizer: str = "adamw"
    parallelism: str = "ddp"
    world_size: int = 1
    shard_teacher: bool = True
    gradient_checkpointing: bool = False
    prompt_len: int = 0
    completion_len: int = 0
    train_batch_size: int = 0
    loss_chunk_size: int = 1024
    sampler: str = "student"
    sampled_rows: int = 0
    ads_copies: int = 2
    proxy_gradients: int = 1
    proxy_on_host: bool = False
    eval_model: str = "teacher"
    eval_batch_size: int = 0
    eval_completion_len: int = 0  # 0: completion_len
    eval_bf16: bool | None = None  # None: bf16
    rollout_engine: str = "hf"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_sleep: bool = False
    engine_dtype: str = "bfloat16"
    sync_streamed: bool = False
    trainable_params: int = 0
    teacher_served: bool = False
    served_dtype: str = "bfloat16"
    gpu_memory_gb: float = 0.0
    cross_tokenizer: bool = False
    teacher_token_ratio: float = 1.0
    other_teachers: tuple[SetMemberShape, ...] = ()
    teachers_routed: bool = False
    eval_student: bool = False
    rollout_ahead: int = 0
    producer_place: str = "beside"

    def __post_init__(self) -> None:
        choices = {
            "optimizer": ("adamw", "sgd", "none"),
            "parallelism": ("ddp", "fsdp"),
            "sampler": ("student", "teacher"),
            "eval_model": ("student", "teacher"),
            "rollout_engine": ("hf", "vllm"),
            "device": ("cuda", "cpu"),
            "producer_place": ("beside", "gpu", "cpu"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {list(allowed)}.")
        for name in ("world_size", "loss_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")
        counts = ("prompt_len", "completion_len", "train_batch_size", "sampled_rows", "eval_batch_size")
        others = ("eval_completion_len", "ads_copies", "proxy_gradients", "trainable_params", "rollout_ahead")
        for name in (*counts, *others):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must not be negative (0: none).")
        if self.teacher_token_ratio < 1:
            raise ValueError(
                f"teacher_token_ratio={self.teacher_token_ratio} is below 1; plan a teacher that cuts "
                "coarser at the student's count (1), which bounds it."
            )
        if self.other_teachers and self.teacher is None:
            raise ValueError(
                "other_teachers are the rest of a set whose first is `teacher`: pass teacher too."
            )
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} is not in (0, 1]."
            )
        for name in ("student_dtype", "teacher_dtype", "proxy_dtype", "engine_dtype", "served_dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name)))
        if self.train_batch_size and self.student is None:
            raise ValueError(
                "train_batch_size > 0 needs the trained model: pass student=ModelShape.from_config(...)."
            )
        if self.rollout_ahead and self.student is None:
            raise ValueError("rollout_ahead > 0 samples the student's rollouts: pass student too.")
        for role, batch in (("sampler", self.sampled_rows), ("eval_model", self.eval_batch_size)):
            if batch and getattr(self, getattr(self, role)) is None:
                raise ValueError(
                    f"{role}={getattr(self, role)!r} decodes, but that model is not in the stage; pass it or "
                    f"choose the other model."
                )

    @property
    def sharded(self) -> bool:
        return self.parallelism == "fsdp" and self.world_size > 1

    def model(self, role: str) -> tuple[ModelShape, str]:
        """(shape, dtype) of "student", "teacher" or "proxy"."""
        return getattr(self, role), getattr(self, f"{role}_dtype")


def optimizer_kind(optim: str, optim_args: str = "") -> str:
    """A transformers `optim` name as the plan counts its state: "adamw" (2 states, also for any optimizer
    not known here), "sgd" with momentum (1), "none" for plain SGD (gradients only)."""
    if optim.startswith("sgd"):
        return (
            "sgd" if "momentum" in optim_args and "momentum=0" not in optim_args.replace(" ", "") else "none"
        )
    return "adamw"
