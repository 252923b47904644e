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
    sent: int = 0
    """Attempts sent, each retry one more: the load the server was given."""
    timed_out: int = 0
    """Attempts with no answer by their deadline: the client gave up (closed its
    connection, cancelled its call), or the server answered 504 / DEADLINE_EXCEEDED."""
    refused: int = 0
    """Attempts refused with 503 / UNAVAILABLE (the server's queue full, a request shed)."""
    in_time: int = 0
    """Requests answered before their client's deadline (counted from when each was first
    sent or, open loop, due); every answered one when the client has no deadline. The
    rest of ``requests`` were answered late, by a retry."""

    @property
    def throughput(self) -> float:
        """Successful requests per second, in time or not."""
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def retried(self) -> int:
        """Attempts that sent a request again, after a timeout or a refusal."""
        return self.sent - self.requests - self.errors

    @property
    def sent_per_s(self) -> float:
        """Attempts per second, retries included."""
        return self.sent / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        """Requests answered before their client's deadline, per second."""
        return self.in_time / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput_share(self) -> float:
        """The share of the requests the clients made (ended in the window: answered or
        failed) that were answered in time; 0 with none."""
        made = self.requests + self.errors
        return self.in_time / made if made else 0.0

    @property
    def inferences_per_s(self) -> float:
        return self.inferences / self.duration_s if self.duration_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            **asdict(self),
            "throughput": self.throughput,
            "inferences_per_s": self.inferences_per_s,
            "retried": self.retried,
            "sent_per_s": self.sent_per_s,
            "goodput": self.goodput,
            "goodput_share": self.goodput_share,
        }


def summarize(
    latencies_s: Sequence[float],
    errors: int,
    duration_s: float,
    rows_per_request: int = 1,
    *,
    sent: int | None = None,
    timed_out: int = 0,
    refused: int = 0,
    in_time: int | None = None,
) -> WindowStats:
    """Stats for the successful requests' latencies (seconds in, milliseconds out);
    ``sent`` defaults to one attempt a request, ``in_time`` to every answer."""
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
        sent=len(ms) + errors if sent is None else sent,
        timed_out=timed_out,
        refused=refused,
        in_time=len(ms) if in_time is None else in_time,
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
