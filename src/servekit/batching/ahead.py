"""When the next batch leaves for a device that runs batches one after another elsewhere.

A batcher whose batches cross a slow boundary (Ray's ingress: each batch is one actor
call to the model's replica, a round trip of milliseconds) keeps the device busy only if
the next batch is already on its way while the current one runs. Sent as soon as a slot
is free, that next batch holds whatever few requests had queued by then: the device stays
busy on small batches (measured: 19-21 rows of 32 at concurrency 64 on a simulated T4).
``Ahead`` holds a batch that would leave while another is out until either it is full or
the batch out is about to come back, so it leaves with every request that queued in the
meantime and still reaches the device before the device frees: the round trip's part
off the device (learned as the shortest round trip seen) plus ``MARGIN_S`` before the
batch out is expected back.
"""

from __future__ import annotations

from collections import deque

__all__ = ["MARGIN_S", "Ahead"]

MARGIN_S = 2e-3
"""How much earlier than strictly needed the next batch leaves."""

_SMOOTHING = 0.25
"""Weight of the newest round trip in each size's moving average."""


class Ahead:
    """Round trips learned per batch size; when a batch may leave with others out.

    ``devices``: batches the far side runs at once (Ray: the model's replicas); up to that
    many leave at once, one more waits as above. All times are on the batcher's clock;
    ``sent`` and ``back`` are told of every batch, and batches are taken to come back in
    the order they left.
    """

    def __init__(self, limit: int, devices: int = 1) -> None:
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        self.limit, self.devices = limit, devices
        self._rtt: dict[int, float] = {}
        """Seconds from leaving to coming back, per rows, for batches sent with none out."""
        self._floor: float | None = None
        """The shortest round trip seen: an upper bound of the part spent off the device."""
        self._out: deque[tuple[float, int, bool]] = deque()
        """Batches out, oldest first: when each left, its rows, whether a device was idle."""
        self._last_back: float | None = None

    def sent(self, rows: int, now: float) -> None:
        self._out.append((now, rows, len(self._out) < self.devices))

    def back(self, now: float) -> None:
        if not self._out:
            return
        left, rows, alone = self._out.popleft()
        if alone:
            took = now - left
            old = self._rtt.get(rows)
            self._rtt[rows] = took if old is None else old + _SMOOTHING * (took - old)
            self._floor = took if self._floor is None else min(self._floor, took)
        self._last_back = now

    def may_leave(self, rows: int, now: float) -> float | None:
        """0 if a batch of ``rows`` may leave now; else how long until it may (None: not
        before a batch out comes back)."""
        if len(self._out) < self.devices or rows >= self.limit:
            return 0.0
        if len(self._out) > self.devices:
            return None  # one batch already waits behind those running
        at = self.expected_back()
        if at is None or self._floor is None:
            return None
        return max(at - (self._floor + MARGIN_S) - now, 0.0)

    def expected_back(self) -> float | None:
        """When the oldest batch out should come back: its round trip at its size (or the
        nearest larger size learned), counted from when it left or, when it left behind
        another, from that one's return less the part off the device."""
        left, rows, alone = self._out[0]
        took = self._rtt.get(rows)
        if took is None:
            larger = [r for r in self._rtt if r > rows]
            if not larger:
                return None
            took = self._rtt[min(larger)]
        if alone or self._last_back is None or self._floor is None:
            return left + took
        return max(left + took, self._last_back + took - self._floor)
