"""Sampling completions: `sampling` (the kit's KV-cached loop, masks and padding), `engines` (what samples a
whole step's prompts: that loop, or vLLM colocated in the process), `source` (what the trainer asks for a
step's rollouts: records with a per-token loss mask), `ahead` (a producer process sampling steps ahead of
training), `microbatches` (a step's prompts joined for one engine
call, cut back into micro-batches by length), `evaluate` (greedy accuracy, raw and
with the final answer forced)."""
