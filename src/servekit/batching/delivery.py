"""A finished batch's results to its callers: counted, in submission order when the policy
asks for it (Triton's ``preserve_ordering``), and reported to the listeners (metrics)."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable

import numpy as np

from ..errors import RunnerError, ServekitError
from .instances import Outcome
from .request import Request
from .stats import BatcherStats, BatchRecord

__all__ = ["Delivery"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class Delivery:
    """Runs on the batcher's loop; ``release`` frees the batch's instance afterwards."""

    def __init__(
        self,
        name: str,
        stats: BatcherStats,
        listeners: list[Callable[[BatchRecord], None]],
        *,
        ordered: bool,
        release: Callable[[], None],
        finished: Callable[[list[Request], float], None] = lambda batch, compute_us: None,
    ) -> None:
        self.name, self.stats, self.listeners = name, stats, listeners
        self._ordered, self._release, self._finished = ordered, release, finished
        self._next = 0
        self._due = 0
        self._held: dict[int, tuple[list[Request], Outcome]] = {}

    def number(self) -> int:
        """The next batch's place in submission order."""
        seq, self._next = self._next, self._next + 1
        return seq

    def complete(
        self, seq: int, batch: list[Request], queue_us: tuple[float, ...], outcome: Outcome
    ) -> None:
        parts, error, compute_us = outcome
        rows = sum(r.rows for r in batch)
        s = self.stats
        s.execution_count += 1
        s.inference_count += rows
        s.batch_rows[rows] += 1
        s.queue_us += sum(queue_us)
        s.compute_us += compute_us
        if self._ordered:
            self._held[seq] = (batch, outcome)
            while self._due in self._held:
                held, (held_parts, held_error, _) = self._held.pop(self._due)
                self._deliver(held, held_parts, held_error)
                self._due += 1
        else:
            self._deliver(batch, parts, error)
        if self.listeners:
            record = BatchRecord(len(batch), rows, queue_us, compute_us, error)
            for listener in self.listeners:
                try:
                    listener(record)
                except Exception:
                    log.exception("batch listener %r failed", listener)
        self._finished(batch, compute_us)
        self._release()

    def _deliver(
        self,
        batch: list[Request],
        parts: list[Arrays | ServekitError] | None,
        error: BaseException | None,
    ) -> None:
        if parts is None:
            self.stats.request_failure += len(batch)
            for r in batch:
                r.fail(error or RunnerError(f"{self.name}: batch failed"))
            return
        failed = 0
        for r, out in zip(batch, parts, strict=True):
            if isinstance(out, BaseException):
                failed += 1
                r.fail(out)
                continue
            self.stats.request_success += 1
            fut = r.future
            if not fut.done():
                try:  # noqa: SIM105 (contextlib.suppress costs more in this loop)
                    fut.set_result(out)
                except concurrent.futures.InvalidStateError:
                    pass  # a thread caller cancelled between the check and the set
        if failed:
            self.stats.request_failure += failed
            if failed < len(batch):
                self.stats.request_isolated += failed
