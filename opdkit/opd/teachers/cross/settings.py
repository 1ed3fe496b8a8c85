"""GOLD's settings for a teacher with another tokenizer (declared in `opdkit.settings`, checked here), and the
rows they read (`prediction_positions`)."""

from __future__ import annotations

from dataclasses import fields

from opdkit.config import check_ranges
from opdkit.settings import CrossTokenizerSettings


def check_settings(settings: CrossTokenizerSettings) -> None:
    check_ranges(settings, fields(CrossTokenizerSettings))


def prediction_positions(prompt_len: int, completion_len: int, settings: CrossTokenizerSettings) -> range:
    """The positions whose hidden states are a completion's rows: P-1+k for token k, one later for
    `crosstok_merge=observed-trl` (TRL's rows)."""
    shift = 0 if settings.crosstok_merge == "observed-trl" else -1
    return range(prompt_len + shift, prompt_len + shift + completion_len)
