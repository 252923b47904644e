"""Shedding (``shed_late``): how long a queue takes to answer, from its own measured
service times, and the refusal of a request whose deadline falls before that.

A request that cannot be answered before its client stops waiting would cost the
device a slot for nobody, and under overload every such request pushes the next one
past its deadline too (goodput falls toward zero while the device is busy). Refused at
once, it costs nothing, and its client can go to another replica or come back after
``Retry-After``. The batcher (native, the Ray ingress) judges with its batches' compute
times; the Triton fronts with the round trips of what they forwarded (``front.window``).
"""

from __future__ import annotations

import math

from ..errors import Shed

__all__ = ["Pace", "late"]

_ALPHA = 0.2
"""Weight of the newest service time: about the last ten count."""


class Pace:
    """The service time of one queue's servers, smoothed (0 until one has been measured)."""

    __slots__ = ("service_s",)

    def __init__(self) -> None:
        self.service_s = 0.0

    def ran(self, seconds: float) -> None:
        """One server finished one unit of work in ``seconds``."""
        if seconds <= 0:
            return
        s = self.service_s
        self.service_s = seconds if not s else s + _ALPHA * (seconds - s)

    def answer_s(self, waves: float) -> float:
        """Expected time until an answer ``waves`` service times away (0: not measured)."""
        return waves * self.service_s


def late(name: str, expected_s: float, left_s: float) -> Shed:
    """The refusal of a request expected to be answered in ``expected_s`` with only
    ``left_s`` left before its deadline: 503 / UNAVAILABLE, ``Retry-After`` the time the
    queue needs to come within the deadline (at least a second, HTTP's unit)."""
    return Shed(
        f"{name}: shed: the queue answers in about {expected_s * 1e3:.0f} ms and the "
        f"request's deadline is {max(left_s, 0.0) * 1e3:.0f} ms away, so it was refused "
        "unrun (shed_late); retry later or elsewhere",
        retry_after_s=max(1.0, math.ceil(expected_s - max(left_s, 0.0))),
    )
