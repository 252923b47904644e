"""Batcher counters and the per-batch hook the metrics exporter subscribes to."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["BatchRecord", "BatcherStats"]


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """What one executed batch did; passed to every listener after it completes."""

    requests: int
    rows: int
    queue_us: tuple[float, ...]
    """Per request: arrival to batch start."""
    compute_us: float
    """Concat, runner call and split, on the instance thread."""
    error: BaseException | None


@dataclass
class BatcherStats:
    """Cumulative counts, with Triton's meanings (``nv_inference_*``)."""

    request_admitted: int = 0
    """Passed admission (valid inputs); each ends as a success, a failure or cancelled."""
    request_success: int = 0
    request_failure: int = 0
    """Failed in execution, timed out, rejected as overloaded, or failed at shutdown."""
    request_invalid: int = 0
    """Refused at admission: inputs that break the signature (not in request_failure,
    which the event loop alone updates; metrics report the two together)."""
    request_isolated: int = 0
    """Failed alone while the rest of their batch was answered (also in failures)."""
    request_cancelled: int = 0
    """Abandoned: the caller stopped waiting (its client left, its call was cancelled or
    its own deadline passed) before the answer came; queued plus running."""
    abandoned_queued: int = 0
    """Abandoned while still queued: dropped, never run (``servekit_requests_abandoned_total``
    with ``where="queued"``)."""
    abandoned_running: int = 0
    """Abandoned once its batch had formed: it ran, its answer was dropped."""
    request_rejected: int = 0
    """Rejected at admission because the queue was full (also counted in failures)."""
    request_shed: int = 0
    """Refused at admission because the queue would answer after its deadline
    (``shed_late``; also counted in failures)."""
    request_timeout: int = 0
    """Timed out in the queue under REJECT (also counted in failures)."""
    inference_count: int = 0
    """Rows executed."""
    execution_count: int = 0
    """Batches executed."""
    queue_us: float = 0.0
    compute_us: float = 0.0
    batch_rows: Counter[int] = field(default_factory=Counter)

    def snapshot(self) -> BatcherStats:
        copy = BatcherStats(**{k: v for k, v in vars(self).items() if k != "batch_rows"})
        copy.batch_rows = Counter(self.batch_rows)
        return copy
