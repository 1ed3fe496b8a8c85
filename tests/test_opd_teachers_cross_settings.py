"""Tests for opdkit.opd.teachers.cross.settings: the settings' names, and the rows a completion's tokens are
read from."""

from __future__ import annotations

import itertools

from opdkit.opd.teachers.cross import (
    CrossTokenizerSettings,
    prediction_positions,
)


def test_every_setting_is_declared_once():
    names = [f for f in CrossTokenizerSettings.__dataclass_fields__]
    assert all(n.startswith("crosstok_") for n in names)
    assert len(list(itertools.chain(names))) == len(set(names))


def test_prediction_positions_are_the_rows_that_predict_each_token():
    # After a 5-token prompt, completion token k is predicted by position 4 + k; TRL's observed reads 5 + k.
    assert list(prediction_positions(5, 3, CrossTokenizerSettings())) == [4, 5, 6]
    trl = CrossTokenizerSettings(crosstok_merge="observed-trl")
    assert list(prediction_positions(5, 3, trl)) == [5, 6, 7]
