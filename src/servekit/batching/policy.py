"""BatchingPolicy: the one description of dynamic batching, rendered to every runtime.

Fields mirror ``model_config.proto``'s ``ModelDynamicBatching`` and ``ModelQueuePolicy``
(plus ``max_batch_size`` from ``ModelConfig``), with the same meaning; units are in
the field names. Where servekit's own batcher deviates it says so below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..tables import check_keys

__all__ = ["BatchingPolicy", "QueuePolicy", "TimeoutAction"]


class TimeoutAction(str, Enum):  # noqa: UP042 (str() of a member stays as it was)
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

    def to_dict(self) -> dict[str, Any]:
        """The ``[batching.queue]`` table of a config file."""
        return {
            "max_queue_size": self.max_queue_size,
            "default_timeout_us": self.default_timeout_us,
            "timeout_action": self.timeout_action.value,
            "allow_timeout_override": self.allow_timeout_override,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "batching.queue") -> QueuePolicy:
        """A queue policy from its table; unknown keys are named with their section."""
        check_keys(section, data, set(cls.__dataclass_fields__), cls)
        return cls(**data)

    def to_triton(self, msg: Any) -> None:
        """Fill a ``ModelQueuePolicy`` message."""
        from tritonclient.grpc import model_config_pb2 as pb

        msg.SetInParent()
        msg.timeout_action = (
            pb.ModelQueuePolicy.DELAY
            if self.timeout_action is TimeoutAction.DELAY
            else pb.ModelQueuePolicy.REJECT
        )
        msg.default_timeout_microseconds = self.default_timeout_us
        msg.allow_timeout_override = self.allow_timeout_override
        msg.max_queue_size = self.max_queue_size

    @classmethod
    def from_triton(cls, msg: Any) -> QueuePolicy:
        from tritonclient.grpc import model_config_pb2 as pb

        return cls(
            max_queue_size=msg.max_queue_size,
            default_timeout_us=msg.default_timeout_microseconds,
            timeout_action=TimeoutAction.DELAY
            if msg.timeout_action == pb.ModelQueuePolicy.DELAY
            else TimeoutAction.REJECT,
            allow_timeout_override=msg.allow_timeout_override,
        )

    def to_pytriton(self) -> Any:
        """PyTriton's ``QueuePolicy``."""
        from pytriton.model_config.common import QueuePolicy as PtQueuePolicy
        from pytriton.model_config.common import TimeoutAction as PtTimeoutAction

        return PtQueuePolicy(
            timeout_action=PtTimeoutAction(self.timeout_action.value),
            default_timeout_microseconds=self.default_timeout_us,
            allow_timeout_override=self.allow_timeout_override,
            max_queue_size=self.max_queue_size,
        )


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

    ``latency_budget_ms`` (servekit's own; 0: off) replaces the queue delay and the
    preferred sizes: each batch's wait and rows are chosen online so that a request's
    time in the server (queue plus compute) stays within the budget at
    ``latency_percentile`` while the device keeps up (``batching.budget``). Where
    tritonserver's batcher assembles the batches it is rendered as a fixed delay
    (``static_delay_us``).

    ``shed_late`` (servekit's own; off by default, as in Triton): a request with a
    deadline (its ``timeout`` parameter, its gRPC deadline, the queue policy's timeout)
    that the queue's measured pace would answer after it is refused at once, 503 /
    UNAVAILABLE with ``Retry-After`` (``batching.pace``), instead of queued to fail late.
    """

    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    latency_budget_ms: float = 0.0
    latency_percentile: float = 99.0
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = field(default_factory=QueuePolicy)
    priority_queue_policies: Mapping[int, QueuePolicy] = field(default_factory=dict)
    """Per-level overrides of ``default_queue_policy`` (``priority_queue_policy``)."""
    shed_late: bool = False

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
        if not self.latency_budget_ms >= 0:  # NaN too
            raise ValueError(f"latency_budget_ms must be >= 0, got {self.latency_budget_ms}")
        if not 0 < self.latency_percentile <= 100:
            raise ValueError(
                f"latency_percentile must be in (0, 100], got {self.latency_percentile}"
            )
        if self.latency_budget_ms and (self.max_queue_delay_us or sizes):
            given = "max_queue_delay_us" if self.max_queue_delay_us else "preferred_batch_sizes"
            raise ValueError(
                f"latency_budget_ms chooses each batch's wait and rows itself: leave out {given} "
                "(max_batch_size stays the upper bound)"
            )
        if self.priority_levels < 0:
            raise ValueError(f"priority_levels must be >= 0, got {self.priority_levels}")
        if self.priority_levels and not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(
                f"default_priority_level must be in [1, {self.priority_levels}] when "
                f"priority_levels is {self.priority_levels}, got {self.default_priority_level}"
            )
        if self.preserve_ordering and self.priority_levels > 1:
            raise ValueError(
                f"preserve_ordering allows one priority level (as in Triton), got "
                f"priority_levels {self.priority_levels}"
            )
        delayed = [
            level
            for level, q in {0: self.default_queue_policy, **self.priority_queue_policies}.items()
            if q.timeout_action is TimeoutAction.DELAY
        ]
        if self.preserve_ordering and delayed:
            raise ValueError(
                "preserve_ordering cannot be combined with timeout_action DELAY (as in Triton); "
                f"DELAY is set for queue level(s) {delayed} (0 = the default queue)"
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
                self.latency_budget_ms,
                self.latency_percentile,
                self.preserve_ordering,
                self.priority_levels,
                self.default_priority_level,
                self.default_queue_policy,
                tuple(self.priority_queue_policies.items()),
                self.shed_late,
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

    def static_delay_us(self) -> int:
        """The fixed queue delay a latency budget is rendered as where tritonserver's own
        batcher assembles the batches: a tenth of the budget, what the budget leaves a
        queue beside a batch that takes most of the rest."""
        return round(self.latency_budget_ms * 100)

    def batch_limit(self, model_max_batch_size: int) -> int:
        """Most rows one batch may hold: the largest preferred size, else max_batch_size."""
        if self.preferred_batch_sizes:
            return self.preferred_batch_sizes[-1]
        return self.effective_max_batch_size(model_max_batch_size) or 1

    # --- the policy's forms on every runtime -------------------------------------------

    def effective_max_batch_size(self, model_max_batch_size: int) -> int:
        """``max_batch_size`` with 0 resolved to the model's; a policy asking for more than
        the model takes is an error naming both numbers. A model that does not batch (0)
        stays at 0."""
        if model_max_batch_size <= 0:
            return 0
        if self.max_batch_size > model_max_batch_size:
            raise ValueError(
                f"max_batch_size {self.max_batch_size} exceeds the model's {model_max_batch_size}"
            )
        return self.max_batch_size or model_max_batch_size

    def to_dict(self) -> dict[str, Any]:
        """The ``[batching]`` table of a config file (``from_dict``'s inverse); defaults
        are written too, so a rendered file says what is in force."""
        data: dict[str, Any] = {
            "max_batch_size": self.max_batch_size,
            "preferred_batch_sizes": list(self.preferred_batch_sizes),
            "max_queue_delay_us": self.max_queue_delay_us,
            "latency_budget_ms": self.latency_budget_ms,
            "latency_percentile": self.latency_percentile,
            "preserve_ordering": self.preserve_ordering,
            "priority_levels": self.priority_levels,
            "default_priority_level": self.default_priority_level,
            "shed_late": self.shed_late,
            "queue": self.default_queue_policy.to_dict(),
        }
        if self.priority_queue_policies:
            data["priority_queues"] = {
                str(level): q.to_dict() for level, q in self.priority_queue_policies.items()
            }
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "batching") -> BatchingPolicy:
        """A policy from a ``[batching]`` table: the fields above, ``queue`` (the default
        ``QueuePolicy``) and ``priority_queues`` (level -> ``QueuePolicy`` table).

        Raises:
            ValueError: an unknown key (named with its section) or a bad value.
        """
        scalars = {
            "max_batch_size",
            "preferred_batch_sizes",
            "max_queue_delay_us",
            "latency_budget_ms",
            "latency_percentile",
            "preserve_ordering",
            "priority_levels",
            "default_priority_level",
            "shed_late",
        }
        check_keys(section, data, scalars | {"queue", "priority_queues"}, cls)
        kwargs: dict[str, Any] = {k: v for k, v in data.items() if k in scalars}
        if "preferred_batch_sizes" in kwargs:
            kwargs["preferred_batch_sizes"] = tuple(kwargs["preferred_batch_sizes"])
        levels = data.get("priority_queues", {})
        if not isinstance(levels, Mapping):
            raise ValueError(f"[{section}.priority_queues]: expected a table, got {levels!r}")
        return cls(
            **kwargs,
            default_queue_policy=QueuePolicy.from_dict(data.get("queue", {}), f"{section}.queue"),
            priority_queue_policies={
                _level(section, k): QueuePolicy.from_dict(v, f"{section}.priority_queues.{k}")
                for k, v in levels.items()
            },
        )

    def to_triton(self, config: Any, model_max_batch_size: int) -> None:
        """Write ``max_batch_size`` and ``dynamic_batching`` into a ``model_config.proto``
        ``ModelConfig`` message (Triton's config.pbtxt) for a model taking up to
        ``model_max_batch_size`` rows (0 = no batching: no batcher is written)."""
        config.max_batch_size = self.effective_max_batch_size(model_max_batch_size)
        if not config.max_batch_size:
            return
        db = config.dynamic_batching
        db.SetInParent()
        db.preferred_batch_size.extend(self.preferred_batch_sizes)
        db.max_queue_delay_microseconds = (
            self.static_delay_us() if self.latency_budget_ms else self.max_queue_delay_us
        )
        db.preserve_ordering = self.preserve_ordering
        db.priority_levels = self.priority_levels
        db.default_priority_level = self.default_priority_level
        if self.default_queue_policy != QueuePolicy():
            self.default_queue_policy.to_triton(db.default_queue_policy)
        for level, q in self.priority_queue_policies.items():
            q.to_triton(db.priority_queue_policy[level])

    @classmethod
    def from_triton(cls, config: Any) -> BatchingPolicy:
        """The policy a ``ModelConfig`` message describes (``to_triton``'s way back).

        Triton fills an unset ``preferred_batch_size`` with ``[max_batch_size]`` in the
        configuration it serves, which batches the same as none: read back as none."""
        db = config.dynamic_batching
        preferred = tuple(db.preferred_batch_size)
        if preferred == (config.max_batch_size,):
            preferred = ()
        return cls(
            max_batch_size=config.max_batch_size,
            preferred_batch_sizes=preferred,
            max_queue_delay_us=db.max_queue_delay_microseconds,
            preserve_ordering=db.preserve_ordering,
            priority_levels=db.priority_levels,
            default_priority_level=db.default_priority_level,
            default_queue_policy=QueuePolicy.from_triton(db.default_queue_policy),
            priority_queue_policies={
                int(k): QueuePolicy.from_triton(v) for k, v in db.priority_queue_policy.items()
            },
        )

    def to_pytriton(self, model_max_batch_size: int) -> Any:
        """PyTriton's ``ModelConfig`` (batching on when the model batches, this policy's
        knobs as its ``DynamicBatcher``, Triton's field names)."""
        from pytriton.model_config import DynamicBatcher, ModelConfig

        max_batch = self.effective_max_batch_size(model_max_batch_size)
        if not max_batch:
            return ModelConfig(batching=False)
        batcher = DynamicBatcher(
            max_queue_delay_microseconds=(
                self.static_delay_us() if self.latency_budget_ms else self.max_queue_delay_us
            ),
            preferred_batch_size=list(self.preferred_batch_sizes) or None,
            preserve_ordering=self.preserve_ordering,
            priority_levels=self.priority_levels,
            default_priority_level=self.default_priority_level,
            default_queue_policy=self.default_queue_policy.to_pytriton(),
            priority_queue_policy={
                k: v.to_pytriton() for k, v in self.priority_queue_policies.items()
            }
            or None,
        )
        return ModelConfig(batching=True, max_batch_size=max_batch, batcher=batcher)


def _level(section: str, key: Any) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ValueError(f"[{section}.priority_queues]: levels are integers, got {key!r}") from None
