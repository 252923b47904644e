"""One autoscaling signal for every runtime: how many replicas a model's traffic needs.

Each server exports, per model, ``servekit_replicas_needed``: the replicas of itself that
the traffic it saw over the last ``window_s`` needs, at the policy's targets. Summed over
a model's servers it is the replica count to ask for (an HPA with an ``AverageValue``
target of 1, or KEDA's Prometheus scaler with a threshold of 1, does exactly that sum).

It reads the counters every runtime exports with Triton's meanings (``nv_inference_*``):

    fill     = rows per execution / max_batch_size            how full the batches are
    busy     = executions * compute per request / (window * instances)
    queue    = queue time per request - max_queue_delay        what waiting costs
    compute  = compute time per request
    slack    = max(latency_budget - compute, latency_budget / 10)
    needed   = max(min(fill, busy) / target_batch_fill, queue / (target_queue_share * slack))

Under dynamic batching a replica that keeps up runs small batches with almost no queue;
as load rises the batches fill (the first term nears 1 before any latency is lost), and
past capacity the queue grows into the latency budget (the second term grows with it,
however full the batches already are). When the traffic stops both fall to 0.

The queue term leaves out the batcher's own hold (``max_queue_delay_us``, waited for
companions by design): more replicas never shorten it, and at low load every replica's
requests wait it whole, so summed over N idle replicas it asked for replicas of their own.

The share of its capacity a replica's traffic takes lies between ``fill * busy`` and
``busy`` (a batch of ``fill`` rows costs at most a full one); ``min(fill, busy)`` stays
within both, and is ``fill`` while the instances never idle. Without ``busy`` a replica
that runs one full batch a minute would ask for a replica of its own forever, and N
replicas each serving lone requests for ``N / (max_batch_size * target_batch_fill)``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .tables import check_keys
from .window import SlidingWindow

__all__ = ["AutoscalePolicy", "Counters", "Demand", "replicas_needed"]


@dataclass(frozen=True)
class AutoscalePolicy:
    """A model's targets for ``servekit_replicas_needed`` (``[models.autoscale]``)."""

    latency_budget_ms: float = 100.0
    """The request latency the model should keep (the p99 it is judged by)."""
    target_batch_fill: float = 0.8
    """Rows per execution, as a share of max_batch_size, that one replica should run at."""
    target_queue_share: float = 0.15
    """The share of the budget left after compute that the mean queue time may take. A
    queue's p99 runs at several times its mean (4-5x in bench/autoscale.py's Poisson
    arrivals at a batching server), and the window's mean lags a rising load: 0.15 asks
    for a replica before the p99 reaches the budget (BENCHMARKS.md, "Autoscaling")."""
    window_s: float = 30.0
    """How far back the counters are read."""

    def __post_init__(self) -> None:
        for key in ("latency_budget_ms", "window_s"):
            if not getattr(self, key) > 0:  # NaN too
                raise ValueError(f"[models.autoscale] {key} must be > 0, got {getattr(self, key)}")
        for key in ("target_batch_fill", "target_queue_share"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(
                    f"[models.autoscale] {key} must be in (0, 1], got {getattr(self, key)}"
                )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], section: str = "models.autoscale"
    ) -> AutoscalePolicy:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        return cls(**data)


@dataclass(frozen=True)
class Counters:
    """Cumulative counts with Triton's meanings: successful requests, rows
    (``nv_inference_count``), executions, and queue and compute microseconds summed over
    requests (``nv_inference_queue_duration_us``, ``..._compute_infer_duration_us``)."""

    requests: float = 0.0
    rows: float = 0.0
    executions: float = 0.0
    queue_us: float = 0.0
    compute_us: float = 0.0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[float, ...]:
        return dataclasses.astuple(self)


def replicas_needed(
    delta: Counters,
    max_batch_size: int,
    policy: AutoscalePolicy,
    elapsed_s: float | None = None,
    instances: int = 1,
    hold_us: float = 0.0,
) -> float:
    """The formula above, over what happened in ``delta`` during ``elapsed_s`` seconds
    (None: the batches' busy share is not known, and counts as 1), with the batcher's hold
    ``hold_us`` (its max_queue_delay); 0 without traffic."""
    if delta.requests <= 0 or delta.executions <= 0:
        return 0.0
    fill = delta.rows / delta.executions / max(max_batch_size, 1)
    queue_ms = max(delta.queue_us / delta.requests - hold_us, 0.0) / 1e3
    compute_ms = delta.compute_us / delta.requests / 1e3
    busy = 1.0
    if elapsed_s is not None and elapsed_s > 0 and compute_ms > 0:
        busy = delta.executions * compute_ms / 1e3 / (elapsed_s * max(instances, 1))
    budget = policy.latency_budget_ms
    slack = max(budget - compute_ms, budget / 10)
    return max(
        min(fill, busy) / policy.target_batch_fill,
        queue_ms / (policy.target_queue_share * slack),
    )


class Demand:
    """One model's signal: readings of its counters, the oldest within the window as the
    base. A reading whose counters went down (the server restarted) starts afresh.
    ``instances``: the batches the model runs at once (its instance group's count);
    ``hold_us``: its batcher's max_queue_delay."""

    def __init__(
        self,
        max_batch_size: int,
        policy: AutoscalePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        instances: int = 1,
        hold_us: float = 0.0,
    ) -> None:
        self.max_batch_size, self.policy, self._clock = (
            max_batch_size,
            policy or AutoscalePolicy(),
            clock,
        )
        self.instances, self.hold_us = instances, hold_us
        self._readings: SlidingWindow[tuple[float, Counters]] = SlidingWindow(
            self.policy.window_s, keep_base=True
        )

    def observe(self, counters: Counters) -> float:
        """Record a reading now; the replicas the traffic since the window's start needs."""
        now = self._clock()
        readings = self._readings
        readings.window_s = self.policy.window_s  # the policy can change (a reload)
        if len(readings) and counters.requests < readings.last()[1].requests:
            readings.clear()  # counters restart from zero with their server
            readings.add(now, (now, Counters()))
        readings.add(now, (now, counters))
        since, base = readings.items(now)[0]
        return replicas_needed(
            counters - base,
            self.max_batch_size,
            self.policy,
            now - since,
            self.instances,
            self.hold_us,
        )
