"""What one `DistillTrainer` process holds, for the memory plan (`memory.Stage`), read from a job's config:
the models' config.json and tokenizers, never their weights. Apart from `opd.arguments` (TrainingArguments,
which takes seconds to import) so that a dry run plans without importing the trainer.

    stage = distill_stage(cfg, world=4, budget=80.0)     # memory.plan_job({"distillation": stage}, 80.0)
"""

from __future__ import annotations

from typing import Any

from opdkit import memory
from opdkit.models import load_tokenizer
from opdkit.opd.teachers import cross
from opdkit.settings import OPDSettings, parse_teachers, parse_weights
from opdkit.tasks.evaluate import evaluation_tokens


def distill_stage(
    cfg: Any, world: int, budget: float | None, tokenizers: tuple | None = None
) -> memory.Stage:
    """What one `DistillTrainer` process holds, for the memory plan, from a config with `OPDSettings`,
    `OPDTraining`, the models', precision and evaluation settings: the fp32 student (bf16 autocast), its
    optimizer, the teacher (sharded under fsdp with several processes), every prompt of an optimizer step
    sampled at once (the kit's loop) or the vLLM engine's share, and the greedy evaluation of the teacher
    and of the student (the student's in the engine with vLLM); with a `teacher_server`, the teacher's head
    and received states only, and the student's evaluation; with `teachers`, every one of them, and the
    student's evaluation. A teacher with another tokenizer reads its own token count (`token_ratio`;
    `tokenizers`: the prepared ones, `teacher_token_ratio`). With `rollout_ahead`, a producer process samples
    instead, where `rollout_device` puts it (`producer_place`). Planned for a GPU when there is a budget."""
    dtype = "bfloat16" if cfg.bf16 else "float32"
    served = bool(getattr(cfg, "teacher_server", ""))  # 04's attackers have no served teacher
    specs = parse_teachers(getattr(cfg, "teachers", ""))  # 04's attackers have no set either
    shape = memory.ModelShape.from_config
    unevaluated = served or bool(specs)  # a served teacher or a set: no teacher evaluated here
    ratio = None if specs else teacher_token_ratio(cfg, tokenizers)  # a set shares the student's tokenizer
    return memory.Stage(
        student=shape(cfg.student_model),
        teacher=shape(specs[0].model if specs else cfg.teacher_model),
        student_dtype="float32",
        teacher_dtype=dtype,
        bf16=cfg.bf16,
        device="cpu" if budget is None else "cuda",
        optimizer=memory.optimizer_kind(cfg.optim, cfg.optim_args),
        parallelism=cfg.parallelism,
        world_size=world,
        shard_teacher=True,  # DistillTrainer shards the teacher too under fsdp with several processes
        gradient_checkpointing=cfg.gradient_checkpointing,
        prompt_len=cfg.max_prompt_length,
        completion_len=OPDSettings.episode_tokens(cfg),  # a multi-turn episode at its longest
        train_batch_size=cfg.per_device_train_batch_size,
        loss_chunk_size=cfg.loss_chunk_size,
        sampled_rows=cfg.per_device_train_batch_size * cfg.accumulation_steps(world),
        eval_model="student" if unevaluated else "teacher",
        eval_student=not unevaluated and cfg.rollout_engine == "hf",
        eval_batch_size=cfg.eval_batch_size if cfg.eval_size else 0,
        eval_completion_len=evaluation_tokens(cfg),  # with an environment, a greedy episode at its longest
        rollout_engine=cfg.rollout_engine,
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_sleep=cfg.vllm_sleep,
        engine_dtype=dtype,
        sync_streamed=True,  # VLLMEngine.sync hands the weights over one tensor at a time
        teacher_served=served or bool(specs and specs[0].server),
        served_dtype=getattr(cfg, "teacher_server_dtype", "bfloat16"),
        cross_tokenizer=ratio is not None,
        teacher_token_ratio=ratio or 1.0,
        other_teachers=tuple(memory.SetMemberShape(shape(t.model), bool(t.server)) for t in specs[1:]),
        teachers_routed=bool(specs) and not parse_weights(getattr(cfg, "teacher_weights", "")),
        rollout_ahead=getattr(cfg, "rollout_ahead", 0),
        producer_place=producer_place(getattr(cfg, "rollout_device", ""), budget),
    )


def producer_place(rollout_device: str, budget: float | None) -> str:
    """Where `rollout_device` puts the rollout producer for the memory plan (`memory.Stage.producer_place`):
    beside the trainer (empty, the trainer's device: cuda or cuda:0 in its one process, cpu on a CPU), on a
    GPU of its own (cuda:N, N >= 1), or on the CPU beside a GPU trainer."""
    if rollout_device in ("", "cuda", "cuda:0") or (rollout_device == "cpu" and budget is None):
        return "beside"
    return "cpu" if rollout_device == "cpu" else "gpu"


def teacher_token_ratio(cfg: Any, tokenizers: tuple | None = None) -> float | None:
    """With a teacher of another tokenizer (`opd.teachers.cross.differ`), its tokens per student token
    (`memory.token_ratio`, at least 1); None when the teacher reads the student's tokens. `tokenizers`: (the
    student's, the teacher's where it differs, else None) as a job's prepare loaded them, not loaded again
    (0.75 s a Qwen3 tokenizer)."""
    if tokenizers is None:
        if cfg.teacher_model == cfg.student_model:
            return None
        student, teacher = load_tokenizer(cfg.student_model), load_tokenizer(cfg.teacher_model)
        tokenizers = (student, teacher if cross.differ(student, teacher) else None)
    student, teacher = tokenizers
    return None if teacher is None else memory.token_ratio(student, teacher)
