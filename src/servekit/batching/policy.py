"""BatchingPolicy: the one description of dynamic batching, rendered to every runtime.

Fields mirror ``model_config.proto``'s ``ModelDynamicBatching`` and ``ModelQueuePolicy``
(plus ``max_batch_size`` from ``ModelConfig``), with the same meaning; units are in
the field names. Where servekit's own batcher deviates it says so below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["BatchingPolicy", "QueuePolicy", "TimeoutAction"]


class TimeoutAction(str, Enum):
    """``ModelQueuePolicy.TimeoutAction``: what happens to a request whose timeout passes in the queue."""

    REJECT = "REJECT"
    """Fail it with ``DeadlineExceeded`` without running it."""
    DELAY = "DELAY"
    """Keep it, but behind every unexpired request of the same or a higher priority."""


@dataclass(frozen=True)
class QueuePolicy:
    """``ModelQueuePolicy``: admission and timeouts for one priority level's queue."""

    max_queue_size: int = 0
    """Requests (not rows) the queue holds; a request arriving when full is rejected at
    once with ``Overloaded``. 0 = unbounded (``max_queue_size``)."""
    default_timeout_us: int = 0
    """Timeout for every request, counted from arrival; 0 = none (``default_timeout_microseconds``)."""
    timeout_action: TimeoutAction = TimeoutAction.REJECT
    allow_timeout_override: bool = False
    """Whether a request's own timeout applies; it may shorten but never lengthen a
    non-zero default (``allow_timeout_override``). When false, request timeouts are ignored."""

    def __post_init__(self) -> None:
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if self.default_timeout_us < 0:
            raise ValueError(f"default_timeout_us must be >= 0, got {self.default_timeout_us}")
        object.__setattr__(self, "timeout_action", TimeoutAction(self.timeout_action))

    def timeout_us(self, requested: int | None) -> int:
        """The timeout that applies to a request asking for ``requested`` (0 = none)."""
        if requested is None or requested <= 0 or not self.allow_timeout_override:
            return self.default_timeout_us
        if self.default_timeout_us:
            return min(requested, self.default_timeout_us)
        return requested


@dataclass(frozen=True)
class BatchingPolicy:
    """Dynamic batching with Triton's semantics.

    - A batch never exceeds ``max_batch_size`` rows, nor the largest preferred size
      when ``preferred_batch_sizes`` is set (Triton's "max preferred batch size"); a
      single request larger than that still runs alone.
    - When a preferred size can be formed from waiting requests it is sent at once
      (the largest such size); otherwise the batcher waits up to
      ``max_queue_delay_us`` after the oldest waiting request for more, then sends
      what it has. With no delay it sends whatever is queued as soon as an instance
      is free.
    - Requests with different non-batch shapes never share a batch: the batch is cut
      at the first request whose shapes differ (no padding, no reordering).
    - ``priority_levels`` > 0 gives levels 1 (highest) .. N, each with its own queue;
      a request's priority 0 means ``default_priority_level``. Higher levels are
      always batched first.
    - ``preserve_ordering``: results are delivered in the order requests were taken
      from the queue, even when instances finish out of order.

    ``max_batch_size`` 0 means "the model's ``max_batch_size``".
    """

    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policies: Mapping[int, QueuePolicy] = field(default_factory=dict)
    """Per-level overrides of ``default_queue_policy`` (``priority_queue_policy``)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
        sizes = tuple(sorted(set(int(s) for s in self.preferred_batch_sizes)))
        if any(s < 1 for s in sizes):
            raise ValueError(f"preferred_batch_sizes must be >= 1, got {list(sizes)}")
        if self.max_batch_size and sizes and sizes[-1] > self.max_batch_size:
            raise ValueError(
                f"preferred batch size {sizes[-1]} exceeds max_batch_size {self.max_batch_size}"
            )
        object.__setattr__(self, "preferred_batch_sizes", sizes)
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us must be >= 0, got {self.max_queue_delay_us}")
        if self.priority_levels < 0:
            raise ValueError(f"priority_levels must be >= 0, got {self.priority_levels}")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(
                f"default_priority_level must be in [1, {self.priority_levels}] when "
                f"priority_levels is {self.priority_levels}, got {self.default_priority_level}"
            )
        if not self.priority_levels and self.default_priority_level:
            raise ValueError("default_priority_level needs priority_levels > 0")
        bad = [k for k in self.priority_queue_policies if not 1 <= k <= self.priority_levels]
        if bad:
            raise ValueError(
                f"priority_queue_policies levels {bad} are outside [1, {self.priority_levels}]"
            )
        # A frozen, hashable copy of the mapping.
        object.__setattr__(
            self, "priority_queue_policies", dict(sorted(self.priority_queue_policies.items()))
        )

    def __hash__(self) -> int:
        return hash(
            (
                self.max_batch_size,
                self.preferred_batch_sizes,
                self.max_queue_delay_us,
                self.preserve_ordering,
                self.priority_levels,
                self.default_priority_level,
                self.default_queue_policy,
                tuple(self.priority_queue_policies.items()),
            )
        )

    @property
    def levels(self) -> int:
        """Number of queues: ``priority_levels``, or 1 when priorities are off."""
        return max(self.priority_levels, 1)

    def level_of(self, priority: int) -> int:
        """Queue level (1-based) for a request's ``priority`` (0 = default); priority-free
        policies put everything on level 1.

        Raises:
            ValueError: priority outside [0, priority_levels].
        """
        if not self.priority_levels:
            return 1
        if priority == 0:
            return self.default_priority_level
        if not 1 <= priority <= self.priority_levels:
            raise ValueError(f"priority must be in [0, {self.priority_levels}], got {priority}")
        return priority

    def queue_policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policies.get(level, self.default_queue_policy)

    def batch_limit(self, model_max_batch_size: int) -> int:
        """Most rows one batch may hold: the largest preferred size, else max_batch_size."""
        if self.preferred_batch_sizes:
            return self.preferred_batch_sizes[-1]
        return self.max_batch_size or model_max_batch_size
