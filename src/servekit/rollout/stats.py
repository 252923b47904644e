"""The tests behind a canary's verdict: is the canary worse than the baseline in the same
window, beyond what chance gives samples of its size? Pure functions, no dependencies.

- ``slower_p``: the Mann-Whitney U test, one-sided (the canary's latencies tend to be
  larger), by its normal approximation with the tie correction (fine from about 20
  requests a version; a verdict waits for ``min_requests``, 200 by default);
- ``tail_p``: how many more of the canary's latencies than the baseline's pass both's
  pooled p99: a canary slow only in its tail, which a rank test can miss;
- ``more_errors_p``: Fisher's exact test, one-sided, of the error counts.

Each returns a p-value: the chance of a difference at least this large between two
versions that are in truth the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["more_errors_p", "slower_p", "tail_p"]


def _normal_sf(z: float) -> float:
    """P(Z >= z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def slower_p(canary: Sequence[float], baseline: Sequence[float]) -> float:
    """One-sided Mann-Whitney U: the p-value of the canary's latencies being as large as
    they are, ranked against the baseline's, were both from one distribution."""
    n1, n2 = len(canary), len(baseline)
    if not n1 or not n2:
        return 1.0
    ranked = sorted([(v, 0) for v in canary] + [(v, 1) for v in baseline])
    rank_sum = 0.0
    ties = 0.0
    i, n = 0, len(ranked)
    while i < n:
        j = i
        while j + 1 < n and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        mid = (i + j) / 2 + 1  # the tied values' mean rank
        rank_sum += mid * sum(1 for k in range(i, j + 1) if ranked[k][1] == 0)
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    u = rank_sum - n1 * (n1 + 1) / 2
    mean = n1 * n2 / 2
    var = n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return 1.0
    return _normal_sf((u - mean - 0.5) / math.sqrt(var))  # continuity-corrected


def tail_p(canary: Sequence[float], baseline: Sequence[float], quantile: float = 0.99) -> float:
    """The p-value of the canary having as many more latencies past the two versions'
    pooled ``quantile`` than the baseline has, were both from one distribution (both
    samples' sizes count, the line's own
    uncertainty with them: Fisher's exact test on those counts)."""
    if not canary or not baseline:
        return 1.0
    pooled = sorted([*canary, *baseline])
    line = pooled[min(len(pooled) - 1, math.ceil(quantile * len(pooled)) - 1)]
    above = sum(1 for v in canary if v > line)
    base_above = sum(1 for v in baseline if v > line)
    return more_errors_p(above, len(canary), base_above, len(baseline))


def more_errors_p(
    canary_errors: int, canary_n: int, baseline_errors: int, baseline_n: int
) -> float:
    """One-sided Fisher exact test: the p-value of the canary holding at least this many of
    the two versions' counted requests (errors, or latencies past a line), were both the
    same; exact at the small counts a window has (a normal approximation is not)."""
    if not canary_n or not baseline_n:
        return 1.0
    total, counted = canary_n + baseline_n, canary_errors + baseline_errors
    if counted == 0 or counted == total:
        return 1.0

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    whole = log_comb(total, canary_n)
    p = 0.0
    for x in range(canary_errors, min(counted, canary_n) + 1):  # the hypergeometric tail
        if canary_n - x <= total - counted:
            p += math.exp(log_comb(counted, x) + log_comb(total - counted, canary_n - x) - whole)
    return min(1.0, p)
