"""Latency statistics and perf_analyzer's stability rule, as pure functions."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ..window import percentile

__all__ = ["WindowStats", "is_stable", "percentile", "rows_per_s", "summarize"]


@dataclass(frozen=True)
class WindowStats:
    """One measurement window (or a merge of several)."""

    requests: int
    """Completed without error."""
    errors: int
    duration_s: float
    inferences: int
    """Rows (images) completed: requests x batch size."""
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def inferences_per_s(self) -> float:
        return self.inferences / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "throughput": self.throughput,
            "inferences_per_s": self.inferences_per_s,
        }


def summarize(
    latencies_s: Sequence[float], errors: int, duration_s: float, rows_per_request: int = 1
) -> WindowStats:
    """Stats for the successful requests' latencies (seconds in, milliseconds out)."""
    ms = sorted(x * 1e3 for x in latencies_s)
    return WindowStats(
        requests=len(ms),
        errors=errors,
        duration_s=duration_s,
        inferences=len(ms) * rows_per_request,
        mean_ms=sum(ms) / len(ms) if ms else math.nan,
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p95_ms=percentile(ms, 95),
        p99_ms=percentile(ms, 99),
    )


def is_stable(windows: Sequence[WindowStats], tolerance: float = 0.1, count: int = 3) -> bool:
    """perf_analyzer's rule: the last ``count`` windows' throughput and p95 latency are each
    within ``tolerance`` of those windows' mean."""
    if len(windows) < count:
        return False
    last = windows[-count:]
    for values in ([w.throughput for w in last], [w.p95_ms for w in last]):
        if any(math.isnan(v) for v in values):
            return False
        mean = sum(values) / count
        if mean == 0 or any(abs(v - mean) > tolerance * mean for v in values):
            return False
    return True


def rows_per_s(call: Callable[[], object], rows: int, seconds: float, warmup: int = 1) -> float:
    """Rows/s of calling ``call`` (``rows`` rows a call) back to back for ``seconds``, after
    ``warmup`` untimed calls: the raw, no-server figure every comparison is against."""
    for _ in range(warmup):
        call()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        n += rows
    return n / (time.perf_counter() - start)
