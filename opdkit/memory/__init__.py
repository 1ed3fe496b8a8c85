"""A per-process memory plan from the models' `config.json` alone, before any weight is loaded.

    shape = ModelShape.from_config  # a dict, a folder holding config.json, or a hub name (config.json only)
    p = plan(Stage(student=shape("Qwen/Qwen3-0.6B"), teacher=shape("Qwen/Qwen3-4B"), bf16=True,
                   train_batch_size=4, sampled_rows=16, prompt_len=1024, completion_len=1024), budget_gb=80)
    print(p.table())  # component, GB, held when, how computed; "plan: 40.9 GB of 80.0 GB per process: fits"

A `Stage` is what one process holds at once (01_save_grad is two stages, the teacher writing traces and
then the proxy's gradient pass: plan both and keep the larger). A row is held "always" or in the phases
it names (rollout, train, bwd-end, step, eval); the phases follow one another, so the total is the
"always" rows plus the largest phase. GB are 10^9 bytes (an "80 GB" A100 or H100 reports about 85e9).
Against a budget every plan holds a reserve row (`reserve_bytes`: 5 % of the budget, at least 2 GB) for
what is not planned by component: the CUDA context, cuBLAS workspaces, NCCL buffers, allocator
fragmentation; `fits` and `largest_batch` (`trace_batch_size: 0`) count it, so neither plans into it.

Pitfalls this module exists for:
- Qwen3 sets `head_dim` (128) explicitly and hidden_size / heads is not it (64 for 0.6B, 80 for 4B):
  the quotient would understate the KV cache and the attention projections;
- a tied embedding is one tensor in the weights, but at the end of backward the head's gradient and the
  embedding's are two vocabulary x hidden tensors being summed;
- the kit's batches are left-padded, and with a padding mask transformers repeats k and v to every query
  head before SDPA and SDPA keeps the mask in the matmul dtype: a GQA model's attention activations grow
  by heads / KV heads, plus one value per column (`activation_bytes_per_token`, counted with
  `saved_tensors_hooks`); eager attention would also keep heads x length probabilities, not planned;
- under bf16 autocast an fp32 model's KV cache keeps K in fp32 (RoPE's fp32 cos and sin, Qwen3's fp32 k_norm
  weight, promote it) and V in bf16 (`kv_bytes_per_token`);
- vLLM reserves `gpu_memory_utilization` x the card's whole memory, not of a smaller budget;
- a rollout producer sampling ahead (`rollout_ahead`) holds its own float32 copy of the student whatever the
  trainer's precision, and on a GPU the whole state_dict it was sent (a tied embedding twice) before
  `load_state_dict` copies it in; its queue holds up to rollout_ahead + 1 weight copies in host memory;
- a vLLM weight sync that casts every parameter to the engine's dtype before handing them over holds the
  whole model in bf16; `engines.VLLMEngine.sync` streams them, one tensor at a time (`Stage.sync_streamed`);
- AdamW steps one tensor at a time on CPU but with `foreach` on CUDA, whose sqrt(v) temporary is as large
  as all parameters together;
- on CPU, torch 2.13's bf16 linear of the last position's (strided) hidden state (`logits_to_keep=1` in the
  kit's decoding loop) is a bmm against the head expanded to every row; where oneDNN takes bf16 matmuls (a
  CPU with AVX512-BF16 or AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`) that expansion is made
  contiguous, a copy of the head per row (128 rows of Qwen3-4B: 99.6 GB); elsewhere (an AVX2-only CPU) the
  BLAS bmm reads the expanded head in place and nothing is copied (`cpu_bf16_head_copies`).

One module per idea: `shapes` (a model's sizes), `stages` (what a process holds, and the byte formulas),
`rows` (the rows of each feature), `plans` (the plan, the batch search, a job's plan), `device` (what this
machine has, what a process holds). The names below are the package's interface.
"""

from opdkit.memory.components import ALWAYS, PHASES, Component, components_of
from opdkit.memory.device import (
    HELD_DIR,
    budget_gb,
    card_gb,
    cpu_bf16_head_copies,
    empty_cuda_cache,
    free_memory,
    held_by,
    held_line,
    host_memory_gb,
    visible_gpu_memory_gb,
)
from opdkit.memory.plans import (
    PLAN_FILE,
    RESERVE_MIN_GB,
    RESERVE_SHARE,
    JobPlan,
    Plan,
    Suggestion,
    largest_batch,
    plan,
    plan_job,
    producer_plans,
    reserve_bytes,
    suggestions,
)
from opdkit.memory.shapes import DTYPE_BYTES, GB, ModelShape, dtype_bytes, dtype_name
from opdkit.memory.stages import (
    TOKEN_SAMPLE,
    SetMemberShape,
    Stage,
    activation_bytes_per_token,
    forward_working_bytes,
    kv_bytes_per_token,
    kv_dtypes,
    optimizer_kind,
    token_ratio,
)

__all__ = [
    "SetMemberShape",
    "TOKEN_SAMPLE",
    "token_ratio",
    "empty_cuda_cache",
    "free_memory",
    "ALWAYS",
    "DTYPE_BYTES",
    "GB",
    "HELD_DIR",
    "JobPlan",
    "ModelShape",
    "PHASES",
    "PLAN_FILE",
    "Plan",
    "RESERVE_MIN_GB",
    "RESERVE_SHARE",
    "Component",
    "Stage",
    "Suggestion",
    "activation_bytes_per_token",
    "budget_gb",
    "card_gb",
    "cpu_bf16_head_copies",
    "dtype_bytes",
    "dtype_name",
    "forward_working_bytes",
    "held_by",
    "held_line",
    "host_memory_gb",
    "kv_bytes_per_token",
    "kv_dtypes",
    "largest_batch",
    "optimizer_kind",
    "plan",
    "plan_job",
    "producer_plans",
    "reserve_bytes",
    "components_of",
    "suggestions",
    "visible_gpu_memory_gb",
]
