"""The statistics behind every verdict, against textbook values and hand computations on synthetic seeds."""

from __future__ import annotations

import math
import random

import pytest

from opdkit.notebook import verdicts as v

# Student's t, two-sided 95 % (the 0.975 quantile), from a printed table (NIST/SEMATECH e-Handbook 1.3.6.7.2).
T_TABLE = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 20: 2.086, 30: 2.042}


@pytest.mark.parametrize("df,t", sorted(T_TABLE.items()))
def test_t_quantile_matches_the_printed_table(df, t):
    assert v.t_quantile(df) == pytest.approx(t, abs=6e-4)


def test_t_quantile_to_six_decimals():
    """Table values to six decimals (R's qt(0.975, df)), tighter than T_TABLE's three."""
    assert v.t_quantile(1) == pytest.approx(12.706205, abs=1e-6)
    assert v.t_quantile(2) == pytest.approx(4.302653, abs=1e-6)
    assert v.t_quantile(4) == pytest.approx(2.776445, abs=1e-6)
    assert v.t_quantile(2, level=0.99) == pytest.approx(9.924843, abs=1e-6)


def test_t_quantile_tends_to_the_normal_and_takes_other_levels():
    assert v.t_quantile(10_000) == pytest.approx(1.960, abs=1e-3)
    assert v.t_quantile(4, level=0.90) == pytest.approx(2.132, abs=6e-4)  # the table's 0.95 column
    assert v.t_quantile(1, level=0.99) == pytest.approx(63.657, abs=1e-2)
    with pytest.raises(ValueError, match="two seeds"):
        v.t_quantile(0)


def test_interval_by_hand_and_its_coverage():
    iv = v.interval([0.62, 0.66, 0.58, None])  # None (a missing seed) is left out
    sd = math.sqrt(((0.0) ** 2 + 0.04**2 + 0.04**2) / 2)
    assert (iv.n, iv.mean) == (3, pytest.approx(0.62))
    assert iv.high - iv.mean == pytest.approx(4.3027 * sd / math.sqrt(3), rel=1e-4)
    assert iv.ci == [iv.low, iv.high]
    one = v.interval([0.5])
    assert (one.n, one.ci, one.low, one.high) == (1, None, 0.5, 0.5)
    assert v.interval([]) is None and v.interval([None]) is None
    rng, hits = random.Random(0), 0  # 95 % of intervals from 3 normal draws cover the true mean
    for _ in range(4000):
        hits += v.interval([rng.gauss(1.0, 2.0) for _ in range(3)]).contains(1.0)
    assert 0.93 < hits / 4000 < 0.97


def test_the_words_are_never_stronger_than_the_interval():
    assert v.verdict("ADS hurts", [0.10, 0.12, 0.08])["word"] == "holds"
    assert v.verdict("ADS hurts", [-0.10, -0.12, -0.08])["word"] == "does not hold"
    assert v.verdict("ADS hurts", [0.20, -0.05, 0.10])["word"] == "within noise at 3 seeds"
    assert v.verdict("ADS hurts", [0.30])["word"] == "within noise at 1 seed"  # one seed: no interval
    lower = v.verdict("lower", [-0.10, -0.12, -0.08], above=False)
    assert lower["word"] == "holds" and lower["ci"][1] < 0 and lower["n"] == 3
    assert v.verdict("x", [None])["word"] == "not measured"
    # a threshold other than 0: a student below its start (0.2) by its whole interval
    assert v.word(v.interval([0.10, 0.12, 0.14]), above=False, threshold=0.2) == "holds"


def test_paired_differences_settle_what_overlapping_intervals_cannot():
    """Seeds that move both arms together: the arms' own intervals overlap, their paired difference does
    not contain 0."""
    clip, noclip = [0.50, 0.70, 0.90], [0.45, 0.66, 0.84]
    a, b = v.interval(clip), v.interval(noclip)
    assert a.low < b.high  # overlapping
    assert v.verdict("clip wins", [x - y for x, y in zip(clip, noclip)])["word"] == "holds"


def test_text_in_percent():
    assert v.pct(0.6234) == "62.3 %" and v.points(-0.031) == "-3.1 points"
    assert v.pct_interval(0.62, [0.55, 0.695], 3) == "62.0 % [55.0, 69.5]"
    assert v.pct_interval(0.04, [-0.01, 0.09], 3, signed=True) == "+4.0 points [-1.0, +9.0]"
    assert v.pct_interval(0.5, None, 1) == "50.0 %"  # the table's caption or the sentence says "1 seed"
    s = v.sentence({"claim": "clip beats noclip", "word": "holds", "mean": 0.2, "ci": [0.1, 0.3], "n": 3})
    assert s == "clip beats noclip: **holds** (+20.0 points [+10.0, +30.0], 3 seeds)."


def test_interpolate_inside_the_range_only():
    xs, ys = [0.9, 0.6, 0.75], [0.8, 0.2, 0.5]
    assert v.interpolate(xs, ys, 0.675) == pytest.approx(0.35)
    assert v.interpolate(xs, ys, 0.9) == pytest.approx(0.8)
    assert v.interpolate(xs, ys, 0.95) is None and v.interpolate(xs, ys, 0.5) is None
    assert v.interpolate([0.7], [0.3], 0.7) == 0.3


def test_crossing_is_where_the_curve_first_falls_to_the_level():
    teacher, student = [0.93, 0.87, 0.75, 0.60], [0.80, 0.41, 0.15, 0.05]
    x = v.crossing(teacher, student, level=0.21)
    assert x == pytest.approx(0.87 + (0.75 - 0.87) * (0.41 - 0.21) / (0.41 - 0.15))
    assert v.crossing(teacher, [0.8, 0.7, 0.6, 0.5], level=0.21) is None  # never within the sweep
    assert v.crossing(teacher, [0.1, 0.3, 0.2, 0.1], level=0.21) is None  # starts below
    assert v.crossing([0.9, 0.8], [0.5, 0.21], level=0.21) == pytest.approx(0.8)
    # the first fall counts, not a later one after a recovery
    assert v.crossing([0.9, 0.8, 0.7, 0.6], [0.5, 0.1, 0.5, 0.1], 0.3) == pytest.approx(0.85)
