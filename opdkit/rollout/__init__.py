"""Sampling completions: `sampling` (the kit's KV-cached loop, masks and padding), `engines` (what samples a
whole step's prompts: that loop, or vLLM colocated in the process), `evaluate` (greedy accuracy, raw and
with the final answer forced)."""
