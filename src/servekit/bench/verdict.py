"""Which runtime wins a figure, and whether by more than the noise: each figure measured
in several interleaved rounds, a 95 % confidence interval on its mean (Student's t), and
the best two compared by Welch's interval on their difference. Pure functions of the
per-round values, so a verdict is tested without a server.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "Verdict", "interval", "judge", "t95"]

_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
"""Student's t, two-sided 95 %, for 1 to 30 degrees of freedom."""


def t95(df: float) -> float:
    """Student's t quantile for a two-sided 95 % interval with ``df`` degrees of freedom
    (rounded down: the wider interval); 1.96 past 30."""
    if df < 1:
        return math.inf
    return _T95[int(df) - 1] if df < 31 else 1.96


@dataclass(frozen=True)
class Interval:
    """A figure's mean over rounds and its 95 % confidence interval (``n`` rounds; one
    round has no interval: ``low`` and ``high`` are NaN)."""

    mean: float
    low: float
    high: float
    n: int

    @property
    def half(self) -> float:
        return (self.high - self.low) / 2

    def text(self, digits: int = 0) -> str:
        """``mean ± half`` (``-`` for no value, the mean alone for one round)."""
        if math.isnan(self.mean):
            return "-"
        if math.isnan(self.half):
            return f"{self.mean:,.{digits}f}"
        return f"{self.mean:,.{digits}f} ± {self.half:,.{digits}f}"


def interval(values: Sequence[float]) -> Interval:
    """The mean of ``values`` (NaN ones left out) with its 95 % interval."""
    xs = [v for v in values if not math.isnan(v)]
    if not xs:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return Interval(mean, math.nan, math.nan, 1)
    half = t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))
    return Interval(mean, mean - half, mean + half, len(xs))


@dataclass(frozen=True)
class Verdict:
    figure: str
    leader: str | None
    """The runtime with the best mean (None: fewer than two runtimes measured it)."""
    winner: str | None
    """The leader where its lead is beyond noise, else None."""
    runner_up: str | None
    beyond_noise: bool
    """Welch's 95 % interval on the best two's difference excludes zero."""
    text: str


def judge(figure: str, rounds: Mapping[str, Sequence[float]], higher_is_better: bool) -> Verdict:
    """The verdict on one figure from each runtime's per-round values: the winner, and
    whether its lead over the runner-up is beyond noise (needs two rounds or more each)."""
    means = {k: interval(v) for k, v in rounds.items()}
    ranked = sorted(
        (k for k, i in means.items() if not math.isnan(i.mean)),
        key=lambda k: means[k].mean,
        reverse=higher_is_better,
    )
    if len(ranked) < 2:
        return Verdict(
            figure, None, None, None, False, f"{figure}: fewer than two runtimes measured"
        )
    best, second = ranked[:2]
    a = [v for v in rounds[best] if not math.isnan(v)]
    b = [v for v in rounds[second] if not math.isnan(v)]
    lead = abs(means[best].mean - means[second].mean)
    share = lead / abs(means[second].mean) if means[second].mean else math.inf
    if len(a) < 2 or len(b) < 2:
        return Verdict(figure, best, None, second, False,
                       f"{figure}: {best} leads {second} by {share:.1%} in one round: no "
                       "interval, no verdict (give --rounds 2 or more)")  # fmt: skip
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        beyond, half = lead > 0, 0.0
    else:
        df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1)) if va or vb else 1
        half = t95(df) * se
        beyond = lead > half
    if beyond:
        text = (f"{figure}: **{best}** wins, by {share:.1%} over {second} "
                f"(difference {lead:,.1f} ± {half:,.1f}, 95 % interval; beyond noise)")  # fmt: skip
    else:
        text = (f"{figure}: {best} and {second} are within noise (difference {lead:,.1f} ± "
                f"{half:,.1f}, 95 % interval): no winner")  # fmt: skip
    return Verdict(figure, best, best if beyond else None, second, beyond, text)
