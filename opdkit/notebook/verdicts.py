"""What a run concludes: means over seeds with their 95 % Student-t intervals, and verdicts no stronger than
those intervals ("holds", "does not hold", "within noise at N seeds").

    iv = interval([0.62, 0.66, 0.58])                # Interval(mean 0.62, low 0.52, high 0.72, n 3)
    v = verdict("clipping keeps training alive", [0.31, 0.12, 0.25])     # per-seed differences, claim > 0
    v["word"]                                        # "holds": the whole interval above 0
    x = crossing([0.93, 0.87, 0.75], [0.80, 0.41, 0.15], level=0.21)    # where y first falls to `level`

Every interval is over seeds: n runs with seeds seed, seed+1, ... (`config.RepeatSettings`), mean ± t(0.975,
n−1)·s/√n. A claim about two arms run with the same seeds (clipped and unclipped; ADS and temperature
sampling; an attacker and its control) is judged on the per-seed differences (paired).

Pitfalls this module exists for:
- with n = 3 a normal interval (±1.96 s/√n) is 2.2 times too narrow: the Student-t quantile with n − 1
  degrees of freedom is 4.30;
- two arms' intervals that overlap do not mean "no difference", nor do disjoint ones measure it: a paired
  difference has its own interval, usually much narrower when the seeds move both arms together;
- one seed has no interval: its verdict is "within noise at 1 seed", never "holds";
- an interpolated crossing exists only inside the sweep: a curve that never falls to the level has no
  crossing (None), not the end of the sweep.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

LEVEL = 0.95  # every interval of the kit
HOLDS, FAILS = "holds", "does not hold"
INTERVAL_NAME = "95 % Student-t interval over seeds"


def noise_word(n: int) -> str:
    return f"within noise at {n} seed{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class Interval:
    """A mean over `n` seeds and its interval (low = high = mean when n = 1: no spread to measure)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def ci(self) -> list[float] | None:
        """[low, high], or None for one seed (no interval)."""
        return [self.low, self.high] if self.n > 1 else None

    def contains(self, value: float) -> bool:
        return self.n < 2 or self.low <= value <= self.high


@functools.lru_cache(maxsize=256)
def t_quantile(df: float, level: float = LEVEL) -> float:
    """The two-sided `level` quantile of Student's t: mean ± this × s/√n covers the true mean with
    probability `level` (12.71 for 1 degree of freedom, 4.30 for 2, 1.96 in the limit)."""
    if df <= 0:
        raise ValueError(f"df={df}: Student's t needs at least one degree of freedom (two seeds).")
    from scipy import stats  # here, not at import: scipy.stats takes seconds, and one seed never asks

    return float(stats.t.ppf(1.0 - (1.0 - level) / 2.0, df))


def interval(values: Iterable[float | None], level: float = LEVEL) -> Interval | None:
    """The mean of the values that are not None, with its Student-t interval; None when there are none."""
    kept = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return None
    n, mean = len(kept), sum(kept) / len(kept)
    if n == 1:
        return Interval(mean, mean, mean, 1)
    sd = math.sqrt(sum((v - mean) ** 2 for v in kept) / (n - 1))
    half = t_quantile(n - 1, level) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def word(iv: Interval | None, above: bool = True, threshold: float = 0.0) -> str:
    """ "holds" when the whole interval lies on the claimed side of `threshold` (above it, or below with
    `above=False`), "does not hold" when it lies wholly on the other side, else "within noise at N seeds"
    (always so for one seed)."""
    if iv is None:
        return "not measured"
    if iv.n < 2 or iv.low <= threshold <= iv.high:
        return noise_word(iv.n)
    return HOLDS if (iv.low > threshold) == above else FAILS


def verdict(
    claim: str, differences: Iterable[float | None], above: bool = True, threshold: float = 0.0
) -> dict:
    """A claim judged on per-seed values (usually paired differences, e.g. clipped minus unclipped accuracy):
    {claim, word, mean, ci, n}; `above` says which side of `threshold` the claim puts them on."""
    iv = interval(differences)
    return {
        "claim": claim,
        "word": word(iv, above, threshold),
        "mean": None if iv is None else iv.mean,
        "ci": None if iv is None else iv.ci,
        "n": 0 if iv is None else iv.n,
    }


def summarize(values: Iterable[float | None]) -> dict:
    """{mean, ci, n} of per-seed values, the form every summary.json keeps its measures in."""
    iv = interval(values)
    return {"mean": None, "ci": None, "n": 0} if iv is None else {"mean": iv.mean, "ci": iv.ci, "n": iv.n}


def pct(value: float | None, digits: int = 1) -> str:
    """A fraction as percent, as the notebooks' text uses it: 0.6234 -> '62.3 %'."""
    return "n/a" if value is None else f"{value * 100:.{digits}f} %"


def points(value: float | None, digits: int = 1) -> str:
    """A difference of fractions as signed percentage points: -0.031 -> '-3.1 points'."""
    return "n/a" if value is None else f"{value * 100:+.{digits}f} points"


def pct_interval(mean: float | None, ci: Sequence[float] | None, n: int, signed: bool = False) -> str:
    """'62.3 % [55.1, 69.5]' (or '+4.2 points [-1.0, +9.4]' with `signed`), the interval in the same unit;
    one seed: the value alone (tables say "one seed" in their caption, sentences after the value)."""
    if mean is None:
        return "n/a"
    head = points(mean) if signed else pct(mean)
    if not ci:
        return head
    fmt = "{:+.1f}" if signed else "{:.1f}"
    return f"{head} [{fmt.format(ci[0] * 100)}, {fmt.format(ci[1] * 100)}]"


def stat_text(d: dict, signed: bool = False) -> str:
    """`pct_interval` of a {mean, ci, n} dict (`summarize`, `verdict`)."""
    return pct_interval(d.get("mean"), d.get("ci"), d.get("n", 0), signed=signed)


def sentence(v: dict, signed: bool = True) -> str:
    """'<claim>: holds (+4.2 points [+1.0, +7.4], 3 seeds).'"""
    seeds = f"{v['n']} seed{'s' if v['n'] != 1 else ''}"
    value = pct_interval(v["mean"], v["ci"], v["n"], signed=signed)
    return f"{v['claim']}: **{v['word']}** ({value}, {seeds})."


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float | None:
    """y at `x` on the piecewise-linear curve through (xs, ys) sorted by x; None outside its range."""
    pts = sorted(zip(xs, ys))
    if not pts or x < pts[0][0] or x > pts[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1]  # a single point, at x


def crossing(xs: Sequence[float], ys: Sequence[float], level: float) -> float | None:
    """Where a sweep's curve first falls to `level`: points in sweep order (weakest perturbation first), x
    linearly interpolated between the last point at or above `level` and the first below it. None when the
    curve starts below `level` or never falls to it within the sweep."""
    pts = list(zip(xs, ys))
    if not pts or pts[0][1] < level:
        return None
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if y0 >= level > y1:
            return x0 + (x1 - x0) * (y0 - level) / (y0 - y1)
        if y1 == level:
            return x1
    return None
