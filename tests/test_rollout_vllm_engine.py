"""Tests for opdkit.rollout.vllm_engine that need no vLLM: its per-sync log notes dropped, nothing else (the
engine itself: tests/test_rollout_engines_vllm.py, marked vllm)."""

from __future__ import annotations

import logging

from opdkit.rollout import vllm_engine


def test_vllms_per_sync_notes_are_dropped_and_nothing_else():
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    root, handler = logging.getLogger("vllm"), Keep()
    root.addHandler(handler)
    try:
        vllm_engine._quiet_sync_logs()
        vllm_engine._quiet_sync_logs()  # twice: one filter each
        layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        pool = logging.getLogger("vllm.v1.core.block_pool")
        layerwise.warning("RotaryEmbedding: Failed to load weights")
        pool.warning("Successfully reset prefix cache")
        layerwise.warning("KV cache is full")
        logging.getLogger("vllm.other").warning("Failed to load weights")  # another logger's: kept
        assert seen == ["KV cache is full", "Failed to load weights"] and len(layerwise.filters) == 1
    finally:
        root.removeHandler(handler)
