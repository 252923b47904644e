"""One percentile and one sliding window for every figure servekit reports: the summaries
on ``/metrics``, the canary's p99, the autoscaling signal and the load generator.

Percentiles are nearest rank, as perf_analyzer reports them: always an observed value,
never an interpolation between two.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

__all__ = ["SlidingWindow", "percentile", "percentiles"]

T = TypeVar("T")


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (p in [0, 100]); NaN when empty:
    the smallest value with at least p % of the values at or below it."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def percentiles(values: Iterable[float], ps: Sequence[float]) -> list[float]:
    """``percentile`` of unsorted ``values`` at each of ``ps``, sorting once."""
    ordered = sorted(values)
    return [percentile(ordered, p) for p in ps]


class SlidingWindow(Generic[T]):
    """What was added in the last ``window_s`` seconds (at most ``maxlen`` items, the
    latest). With ``keep_base``, the last item from before the window stays as well: a
    window of counter readings needs the reading its differences start from."""

    def __init__(
        self, window_s: float, *, maxlen: int | None = None, keep_base: bool = False
    ) -> None:
        self.window_s, self.keep_base = window_s, keep_base
        self._items: collections.deque[tuple[float, T]] = collections.deque(maxlen=maxlen)

    def add(self, now: float, item: T) -> None:
        self._items.append((now, item))

    def clear(self) -> None:
        self._items.clear()

    def items(self, now: float) -> list[T]:
        """The items still in the window at ``now``, oldest first."""
        start = now - self.window_s
        items = self._items
        if self.keep_base:
            while len(items) > 2 and items[1][0] <= start:
                items.popleft()
        else:
            while items and items[0][0] < start:
                items.popleft()
        return [item for _, item in items]

    def __len__(self) -> int:
        return len(self._items)

    def last(self) -> T:
        return self._items[-1][1]
