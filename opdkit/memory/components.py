"""The plan's rows, one feature at a time: the student's weights, optimizer and training; decoding; the vLLM
engine; a sharded, served or ADS teacher; evaluation (`components_of`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from opdkit.memory.device import cpu_bf16_head_copies
from opdkit.memory.shapes import GB, ModelShape, dtype_bytes
from opdkit.memory.stages import (
    Stage,
    activation_bytes_per_token,
    forward_working_bytes,
    kv_bytes_per_token,
    kv_dtypes,
)

ALWAYS = "always"
PHASES = ("rollout", "train", "bwd-end", "step", "eval")

# `losses.chunked_divergence` works on blocks of this many rows (`losses._ROW_BLOCK`) with about this
# many fp32 rows x vocabulary temporaries at once.
_ROW_BLOCK = 64
_ROW_BLOCK_BUFFERS = 3

# A rollout record (`rollout.source.RolloutRecord`) per token column: its input ids, attention mask and loss
# mask (int64) and the sampler's log-probabilities (float32); per row its `truncated_B` flag (bool). A planned
# prompt micro-batch per token: its ids and attention mask (int64).
RECORD_BYTES_PER_TOKEN = 8 + 8 + 8 + 4
RECORD_BYTES_PER_ROW = 1
PROMPT_BYTES_PER_TOKEN = 8 + 8


@dataclass(frozen=True)
class Component:
    """One component: bytes per process, held "always" or in the phases `phase` names (joined by "+")."""

    component: str
    bytes: int
    how: str
    phase: str = ALWAYS

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(self.phase.split("+"))


def _n(n: int) -> str:
    return f"{n:,}"


def _student_components(s: Stage) -> list[Component]:
    m, wd = s.model("student")
    wb, w = dtype_bytes(wd), s.world_size
    div = w if s.sharded else 1
    per = f" / {w} (fsdp)" if div > 1 else ""
    states = {"adamw": 2, "sgd": 1, "none": 0}[s.optimizer]
    n = s.trainable_params or m.num_params  # what trains: gradients and optimizer state are theirs
    which = f"{_n(n)} trainable params" if s.trainable_params else "params"
    weights = m.num_params + s.trainable_params
    how = f"{_n(m.num_params)} params" + (
        f" + {_n(s.trainable_params)} adapter params" if s.trainable_params else ""
    )
    rows = [
        Component("student weights", weights * wb // div, f"{how} x {wb} B ({wd})" + per),
        Component(
            "optimizer state", states * n * wb // div, f"{s.optimizer}: {states} x {which} x {wb} B" + per
        ),
    ]
    if not s.train_batch_size:
        return rows
    rows.append(
        Component("student gradients", n * wb // div, f"{which} x {wb} B" + per, "train+bwd-end+step")
    )
    if m.tie_embeddings and not s.trainable_params:  # adapters leave the embedding frozen
        grad_bytes = 2 if (s.bf16 and s.sharded) else wb
        rows.append(
            Component(
                "tied embedding gradient sum",
                m.embedding_params * grad_bytes,
                f"the head's and the embedding's {_n(m.vocab_size)} x {m.hidden_size} gradients being summed",
                "bwd-end",
            )
        )
    if s.parallelism == "ddp" and w > 1:
        rows.append(
            Component("ddp gradient buckets", n * wb, "DDP's reducer keeps a flat copy of every gradient")
        )
    if s.optimizer == "adamw":
        if s.device == "cuda":
            temp, how = n * wb // div, "foreach AdamW: sqrt(v) of all parameters at once"
        else:
            largest = min(m.largest_tensor_numel, n)
            temp, how = 2 * largest * wb, "one tensor at a time: 2 x the largest tensor"
        rows.append(Component("optimizer step temporaries", temp, how, "step"))
    if s.sharded:
        # FSDP gathers the root unit and one decoder layer while it prefetches the next: in bf16 under
        # mixed precision, else in the weights' own dtype.
        unit = m.embedding_params * (1 if m.tie_embeddings else 2) + 2 * m.layer_params
        ub = 2 if s.bf16 else wb
        what = "mixed-precision copies" if s.bf16 else "fsdp gathered units"
        how = f"FSDP's {'bf16 ' if s.bf16 else ''}all-gathers: the root (embedding, head) + 2 decoder layers"
        how += f", {ub} B"
        rows.append(Component(what, unit * ub, how, "train"))
    elif s.bf16 and wb > 2:
        linear = m.num_layers * m.layer_linear_params
        how = f"autocast's bf16 casts of the {_n(linear)} layer weights, 2 B"
        rows.append(Component("mixed-precision copies", linear * 2, how, "train"))
    return rows + _training_components(s)


def _training_components(s: Stage) -> list[Component]:
    """Activations, and with a teacher the chunked divergence's buffers."""
    m, wd = s.model("student")
    residual = 2 if (s.bf16 and s.sharded) else dtype_bytes(wd)
    compute = 2 if s.bf16 else dtype_bytes(wd)
    cast = s.bf16 and residual > 2
    length = s.prompt_len + s.completion_len
    tokens, n_pred = s.train_batch_size * length, s.train_batch_size * s.completion_len
    per = activation_bytes_per_token(m, residual, compute, cast, masked_len=length)
    # The final norm's fp32 input and output; both models' final hidden states at the predicted positions.
    final = tokens * (4 + residual) * m.hidden_size + n_pred * m.hidden_size * residual
    if s.teacher is not None:  # every teacher's, at the teacher's own token count
        final += _teacher_tokens(s, n_pred) * _teachers_width(s) * dtype_bytes(s.teacher_dtype)
    if s.gradient_checkpointing:
        act = tokens * (m.num_layers * m.hidden_size * residual + per) + final
        how = f"{_n(tokens)} tokens x ({m.num_layers} layer inputs x {m.hidden_size} x {residual} B + 1 layer"
    else:
        act = tokens * m.num_layers * per + final
        how = f"{_n(tokens)} tokens x ({m.num_layers} layers"
    how += f" x {_n(per)} B/token/layer) + final norm and hidden states"
    rows = [Component("activations", act, how, "train")]
    if s.teacher is None:
        return rows
    if s.cross_tokenizer:
        return rows + _cross_tokenizer_components(s, m, n_pred)
    vocab, chunk = min(m.vocab_size, s.teacher.vocab_size), min(s.loss_chunk_size, n_pred)
    # The divergence runs outside autocast: each head's matmul is in its weights' dtype (the student's is
    # bf16 only as FSDP's unsharded copy); a half-precision product is converted to fp32 beside the other.
    s_head = 2 if (s.bf16 and s.sharded) else dtype_bytes(wd)
    low = min(s_head, dtype_bytes(s.teacher_dtype))
    per_row = 8 + (low if low < 4 else 0)
    how = f"{_n(chunk)} rows x {_n(vocab)} x {per_row} B (both log-probs in fp32"
    how += f", a {low} B matmul output)" if low < 4 else ")"
    how += f" + {_ROW_BLOCK} x {_ROW_BLOCK_BUFFERS} fp32 row-block buffers"
    chunk_bytes = chunk * vocab * per_row + _ROW_BLOCK * _ROW_BLOCK_BUFFERS * vocab * 4
    rows.append(Component("divergence chunk logits", chunk_bytes, how, "train"))
    if s_head < 4:
        how = "the head's gradient summed in fp32 over the chunks (the unsharded head is bf16)"
        rows.append(Component("divergence head gradient", m.embedding_params * 4, how, "train"))
    elif s.parallelism == "ddp" and s.world_size > 1 and not s.trainable_params:
        how = "the head's fp32 gradient from the divergence, beside the .grad DDP's reducer allocates"
        rows.append(Component("divergence head gradient", m.embedding_params * 4, how, "train"))
    return rows


def _teacher_tokens(s: Stage, tokens: int) -> int:
    """A teacher's token count for `tokens` of the student's (`Stage.teacher_token_ratio`)."""
    return math.ceil(tokens * s.teacher_token_ratio)


def _teachers_width(s: Stage) -> int:
    """The hidden sizes of every teacher of the stage, side by side (one teacher: its own)."""
    return s.teacher.hidden_size + sum(t.shape.hidden_size for t in s.other_teachers)


def _cross_tokenizer_components(s: Stage, m: ModelShape, n_pred: int) -> list[Component]:
    """The loss's chunk (`_cross_tokenizer_chunk`) and, when the head trains, the head's gradient the
    backward pass returns whole: vocabulary x hidden in the head's dtype, beside `.grad` while micro-batches
    accumulate (the trained adapters of LoRA leave the head frozen: none)."""
    rows = [_cross_tokenizer_chunk(s, m, n_pred)]
    if not s.trainable_params:
        hb = 2 if (s.bf16 and s.sharded) else dtype_bytes(s.student_dtype)
        how = f"{_n(m.vocab_size)} x {m.hidden_size} x {hb} B, returned whole by the loss's backward pass"
        rows.append(Component("cross-tokenizer head gradient", m.embedding_params * hb, how, "train"))
    return rows


def _cross_tokenizer_chunk(s: Stage, m: ModelShape, n_pred: int) -> Component:
    """GOLD's loss, `loss_chunk_size` groups at a time (at most one per student token): each side's log-probs
    and merged probabilities in fp32 at its own vocabulary, and the sorted L1's keys and buckets; the
    backward pass (`cross.divergence._StudentLoss`) rebuilds each chunk into the same buffers."""
    chunk, both = min(s.loss_chunk_size, n_pred), m.vocab_size + s.teacher.vocab_size
    how = f"{_n(chunk)} groups x ({_n(m.vocab_size)} + {_n(s.teacher.vocab_size)} teacher) x 16 B"
    return Component("cross-tokenizer chunk", chunk * both * 16, how, "train")


def _decode_components(
    s: Stage, role: str, batch: int, length: int, phase: str, autocast: bool
) -> list[Component]:
    """The kit's KV-cached loop: the cache (in the dtypes the model keeps it, `kv_bytes_per_token`), the
    prefill's working set, and on CPU the bf16 head copies where this torch makes them."""
    m, weights = s.model(role)
    what = f"{role} {'rollout' if phase == 'rollout' else 'evaluation'}"
    per = kv_bytes_per_token(m, weights, autocast)
    kv = batch * length * per
    compute = 2 if autocast else dtype_bytes(weights)
    work = forward_working_bytes(m, batch * s.prompt_len, compute)
    work += kv // m.num_layers + 3 * batch * m.vocab_size * 4
    rows = [
        Component(
            f"KV cache, {what}",
            kv,
            f"{batch} rows x {_n(length)} tokens x {_n(per)} B/token ({kv_dtypes(weights, autocast)})",
            phase,
        ),
        Component(
            f"decoding working set, {what}",
            work,
            "prefill: one layer's tensors for every prompt token; a layer's cache being extended; logits",
            phase,
        ),
    ]
    bf16_on_cpu = s.device == "cpu" and dtype_bytes(weights) == 2
    if bf16_on_cpu and (cpu_bf16_head_copies() if s.cpu_bf16_head_copies is None else s.cpu_bf16_head_copies):
        how = (
            f"{batch} rows x the head ({_n(m.vocab_size)} x {m.hidden_size} x 2 B): torch's CPU bf16 linear "
        )
        how += "copies the weight per row of a strided input (oneDNN's bf16 bmm)"
        rows.append(
            Component(f"CPU {weights} head copies, {what}", batch * m.embedding_params * 2, how, phase)
        )
    return rows


def _engine_components(s: Stage, budget: float | None) -> list[Component]:
    if budget is None:
        raise ValueError(
            "rollout_engine=vllm reserves a share of the GPU's memory: pass budget_gb (the GPU's memory, or "
            "plan_gpu_memory_gb) so the plan can size it."
        )
    card = s.gpu_memory_gb * GB or budget
    whose = "the visible GPU's memory" if s.gpu_memory_gb else "the budget (no GPU visible: its memory)"
    how = f"vllm_gpu_memory_utilization {s.vllm_gpu_memory_utilization} x {card / GB:.1f} GB, {whose}"
    phase = ALWAYS
    if s.vllm_sleep:
        how, phase = how + ", freed between rollouts (vllm_sleep)", "rollout"
    rows = [Component("rollout engine (vllm)", int(s.vllm_gpu_memory_utilization * card), how, phase)]
    if s.student is not None:
        m, wd = s.model("student")
        eb = dtype_bytes(s.engine_dtype)
        if s.sync_streamed:
            sync, how = m.largest_tensor_numel * eb, "one tensor at a time: the largest"
        elif wd != s.engine_dtype or s.sharded:
            sync, how = m.num_params * eb, f"every parameter in {s.engine_dtype} at once (VLLMEngine.sync)"
        else:
            sync, how = 0, "the live parameters themselves (same dtype, not sharded)"
        rows.append(Component("weight-sync buffer", sync, how, "rollout"))
    return rows


def producer_device(s: Stage) -> str:
    """Where the rollout producer of `rollout_ahead` lives: "cuda" or "cpu"."""
    return {"beside": s.device, "gpu": "cuda", "cpu": "cpu"}[s.producer_place]


def producer_components(s: Stage, budget: float | None) -> list[Component]:
    """The rollout producer of `rollout_ahead` (`rollout.ahead._produce`), held "always": it samples beside
    every phase of the trainer, and its caching allocator keeps what it once held. The kit's loop: its own
    float32 copy of the student (built from the config, whatever the trainer's precision); on a GPU, each
    weight update's state_dict moved to the device whole before `load_state_dict` copies it in; the KV cache
    and working set of the step's `sampled_rows` rows, decoded without autocast. vLLM: the engine's share and
    its weight-sync buffer, as a synchronous engine's (`budget` sizes the share where no card is known)."""
    if s.rollout_engine == "vllm":
        return [
            Component(f"{r.component}, rollout producer", r.bytes, r.how)
            for r in _engine_components(s, budget)
        ]
    m, wd = s.model("student")
    rows = [
        Component(
            "rollout producer weights",
            m.num_params * 4,
            f"{_n(m.num_params)} params x 4 B (float32): the producer's copy of the student",
        )
    ]
    device = producer_device(s)
    if device == "cuda":
        n, wb = m.state_dict_numel, dtype_bytes(wd)
        how = f"{_n(n)} state_dict values x {wb} B ({wd}) on the device at once, then loaded"
        how += " (a tied embedding under both names)" if m.tie_embeddings else ""
        rows.append(Component("rollout producer weight update", n * wb, how))
    own = dataclasses.replace(s, student_dtype="float32", device=device)
    length = s.prompt_len + s.completion_len
    for r in _decode_components(own, "student", s.sampled_rows, length, "rollout", autocast=False):
        rows.append(Component(r.component.replace("student rollout", "rollout producer"), r.bytes, r.how))
    return rows


def queue_components(s: Stage) -> list[Component]:
    """The producer's queues in host memory (shared memory, `rollout.ahead`): the student's state_dict copies
    the trainer sends after each optimizer step, at most `rollout_ahead` + 1 at once (the newest, and up to
    `rollout_ahead` older ones the producer has not loaded yet: it is that many steps behind the trainer),
    the records of the `rollout_ahead` steps sampled ahead, and those steps' prompts."""
    m, wd = s.model("student")
    ahead, wb, rows_ = s.rollout_ahead, dtype_bytes(wd), s.sampled_rows
    copies, n = ahead + 1, m.state_dict_numel
    length = s.prompt_len + s.completion_len
    record = rows_ * (length * RECORD_BYTES_PER_TOKEN + RECORD_BYTES_PER_ROW)
    steps = f"{ahead} step{'s' * (ahead > 1)} x {rows_} rows"
    return [
        Component(
            "weights in the producer's queue",
            copies * n * wb,
            f"{copies} state_dict copies (the newest, {ahead} not loaded yet) x {_n(n)} values x {wb} B",
        ),
        Component(
            "rollouts in the producer's queue",
            ahead * record,
            f"{steps} x ({_n(length)} tokens x {RECORD_BYTES_PER_TOKEN} B + "
            f"{RECORD_BYTES_PER_ROW} B): ids, masks (int64), log-probs (float32)",
        ),
        Component(
            "prompts planned ahead",
            ahead * rows_ * s.prompt_len * PROMPT_BYTES_PER_TOKEN,
            f"{steps} x {_n(s.prompt_len)} tokens x {PROMPT_BYTES_PER_TOKEN} B",
        ),
    ]


def _sharded_teacher_components(s: Stage) -> list[Component]:
    """What a sharded teacher holds whole beyond its shard: while it decodes, its root unit (embedding,
    head) and one decoder layer gathered; in training, the copy of its head the divergence keeps from the
    loss's forward to its backward (`DistillTrainer._teacher_part`)."""
    m, dt = s.model("teacher")
    b = dtype_bytes(dt)
    rows = []
    if s.train_batch_size:
        how = f"{_n(m.embedding_params)} x {b} B, from the loss's forward to its backward"
        rows.append(Component("teacher head copy (fsdp)", m.embedding_params * b, how, "train"))
    decodes = [
        phase
        for phase, runs in (
            ("rollout", s.sampled_rows and s.sampler == "teacher" and s.rollout_engine == "hf"),
            ("eval", s.eval_batch_size and s.eval_model == "teacher"),
        )
        if runs
    ]
    if decodes:
        root = m.embedding_params * (1 if m.tie_embeddings else 2)
        how = f"(root {_n(root)} + one layer {_n(m.layer_params)} params) x {b} B, while it decodes"
        rows.append(
            Component("teacher gathered units (fsdp)", (root + m.layer_params) * b, how, "+".join(decodes))
        )
    return rows


def _served_teacher_components(s: Stage) -> list[Component]:
    """A served teacher (`opd.teachers.served.ServedTeacher`): its head, and one micro-batch's states in the
    padded layout; the step's states as received (each row's that predict a loss token: at most its
    completion's, a multi-turn episode's at its longest) wait in host memory."""
    m, dt = s.model("teacher")
    h, sb, tb = m.hidden_size, dtype_bytes(s.served_dtype), dtype_bytes(dt)
    kept = _teacher_tokens(s, s.sampled_rows * s.completion_len)
    padded = _teacher_tokens(s, s.train_batch_size * (s.prompt_len + s.completion_len))
    return [
        Component(
            "teacher head (served teacher)",
            m.embedding_params * tb,
            f"{_n(m.embedding_params)} x {tb} B ({dt})",
        ),
        Component(
            "served teacher states",
            padded * h * tb,
            f"{_n(padded)} tokens x {h} x {tb} B; the step's {_n(kept)} tokens x {h} x {sb} B "
            f"({s.served_dtype}) wait in host memory",
            "train",
        ),
    ]


def components_of(s: Stage, budget: float | None) -> list[Component]:
    """Every row of `s`; `budget` sizes a vLLM engine's share where no card is known."""
    rows: list[Component] = _student_components(s) if s.student is not None else []
    if s.teacher is not None and s.teacher_served:
        rows += _served_teacher_components(s)
    elif s.teacher is not None:
        m, dt = s.model("teacher")
        div = s.world_size if (s.sharded and s.shard_teacher) else 1
        how = f"{_n(m.num_params)} params x {dtype_bytes(dt)} B ({dt})" + (
            f" / {div} (fsdp)" if div > 1 else ""
        )
        rows.append(Component("teacher weights", m.num_params * dtype_bytes(dt) // div, how))
        if div > 1:
            rows += _sharded_teacher_components(s)
    if s.other_teachers:
        rows += _other_teacher_components(s)
    if s.proxy is not None:
        m, dt = s.model("proxy")
        b, n = m.num_params * dtype_bytes(dt), _n(m.num_params)
        host = "in CPU memory (proxy_on_host)"
        grads = s.proxy_gradients * m.num_params * 4
        rows += [
            Component(
                "ADS proxy",
                0 if s.proxy_on_host else b,
                host if s.proxy_on_host else f"{n} params x 4 B ({dt})",
            ),
            Component(
                "ADS proxy gradients",
                0 if s.proxy_on_host else grads,
                host if s.proxy_on_host else f"{s.proxy_gradients} x {n} params x 4 B (float32)",
            ),
            Component(
                "ADS perturbed copies", s.ads_copies * b, f"{s.ads_copies} x {n} params x {dtype_bytes(dt)} B"
            ),
        ]
    length = s.prompt_len + s.completion_len
    if (
        s.rollout_ahead
    ):  # a producer process samples them (`producer_components`): here when it shares the device
        rows += producer_components(s, budget) if s.producer_place == "beside" else []
    elif s.rollout_engine == "vllm":
        rows += _engine_components(s, budget)
    elif s.sampled_rows:
        rows += _decode_components(s, s.sampler, s.sampled_rows, length, "rollout", s.bf16)
        # Steering the teacher's sampling, the copies decode beside it, each with its KV cache; scoring a
        # student's rollouts (04's on-policy attackers, `sampler` "student"), they read whole sequences.
        if s.proxy is not None and s.ads_copies and s.sampler == "teacher":
            m, dt = s.model("proxy")
            per = kv_bytes_per_token(m, dt, s.bf16)
            how = f"{s.ads_copies} copies x {s.sampled_rows} rows x {_n(length)} tokens x {_n(per)} B/token"
            rows.append(
                Component(
                    "KV cache, ADS perturbed copies",
                    s.ads_copies * s.sampled_rows * length * per,
                    how,
                    "rollout",
                )
            )
    if s.proxy is not None and s.ads_copies and s.teacher is not None and s.sampler == "student":
        rows.append(_stacked_head_component(s))
    if s.eval_batch_size:
        eval_len = s.prompt_len + (s.eval_completion_len or s.completion_len)
        autocast = s.bf16 if s.eval_bf16 is None else s.eval_bf16
        rows += _decode_components(s, s.eval_model, s.eval_batch_size, eval_len, "eval", autocast)
        if s.eval_student and s.eval_model != "student":
            rows += _decode_components(s, "student", s.eval_batch_size, eval_len, "student-eval", autocast)
    return rows


def _other_teacher_components(s: Stage) -> list[Component]:
    """Each teacher of a set beyond the first: its weights (sharded as the first is), or a served one's head
    and one micro-batch's states; routed, every teacher's head stacked side by side once, at the rows all
    of them have (`opd.teachers.sets.RoutedTeacher`)."""
    b, dt = dtype_bytes(s.teacher_dtype), s.teacher_dtype
    div = s.world_size if (s.sharded and s.shard_teacher) else 1
    padded = _teacher_tokens(s, s.train_batch_size * (s.prompt_len + s.completion_len))
    rows = []
    for k, t in enumerate(s.other_teachers, start=2):
        m = t.shape
        if t.served:
            how = f"{_n(m.embedding_params)} x {b} B ({dt})"
            rows.append(Component(f"teacher {k} head (served teacher)", m.embedding_params * b, how))
            how = f"{_n(padded)} tokens x {m.hidden_size} x {b} B"
            rows.append(Component(f"served teacher {k} states", padded * m.hidden_size * b, how, "train"))
        else:
            how = f"{_n(m.num_params)} params x {b} B ({dt})" + (f" / {div} (fsdp)" if div > 1 else "")
            rows.append(Component(f"teacher {k} weights", m.num_params * b // div, how))
    if s.teachers_routed:
        vocab = min(s.teacher.vocab_size, *(t.shape.vocab_size for t in s.other_teachers))
        width = _teachers_width(s)
        how = f"{_n(vocab)} x {width} (every teacher's hidden size) x {b} B"
        rows.append(Component("stacked teachers' head", vocab * width * b, how))
    return rows


def _stacked_head_component(s: Stage) -> Component:
    """The ADS teacher scoring a student's rollouts (04's on-policy attackers, `ads.teacher`) puts the
    teacher's and the perturbed copies' heads side by side in one fp32 matrix, built once."""
    t, p = s.teacher, s.proxy
    cols = t.hidden_size + s.ads_copies * p.hidden_size
    bytes_ = max(4, dtype_bytes(s.teacher_dtype), dtype_bytes(s.proxy_dtype))
    how = f"{_n(t.vocab_size)} x ({t.hidden_size} + {s.ads_copies} x {p.hidden_size}) x {bytes_} B"
    return Component("ADS teacher stacked head", t.vocab_size * cols * bytes_, how)
