"""The canary's verdict: a pure function of two versions' windows and the policy.

A window holds what one version did since the last verdict: requests, errors, latencies
and, where a shadow ran beside the answer, how many answers matched the baseline's.
No verdict before both versions have ``min_requests``; then the canary fails on the
first limit it breaks (each reason named with its figures), else it passes.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from ..window import percentile
from .policy import CanaryPolicy

__all__ = ["Verdict", "Window", "judge"]

LATENCIES_KEPT = 20_000
"""Latencies a window keeps for its p99 (the latest; a window is usually far smaller)."""


@dataclass
class Window:
    """One version's figures since the last verdict."""

    requests: int = 0
    errors: int = 0
    compared: int = 0
    mismatches: int = 0
    latencies: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LATENCIES_KEPT)
    )

    def add(self, latency_s: float, ok: bool) -> None:
        self.requests += 1
        if ok:
            self.latencies.append(latency_s)
        else:
            self.errors += 1

    def p99(self) -> float:
        """The 99th percentile of the successful requests' latencies, seconds (nan: none)."""
        return percentile(sorted(self.latencies), 99)

    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    def mismatch_rate(self) -> float:
        return self.mismatches / self.compared if self.compared else 0.0

    def figures(self) -> dict[str, Any]:
        p99 = self.p99()
        return {
            "requests": self.requests,
            "errors": self.errors,
            "error_rate": round(self.error_rate(), 6),
            "p99_ms": None if math.isnan(p99) else round(p99 * 1e3, 3),
            "compared": self.compared,
            "mismatches": self.mismatches,
        }


@dataclass(frozen=True)
class Verdict:
    """``wait`` (not enough requests yet), ``pass`` or ``fail``, with why."""

    kind: str
    reasons: tuple[str, ...] = ()


def judge(canary: Window, baseline: Window, policy: CanaryPolicy) -> Verdict:
    """The canary's verdict on this window against the baseline's."""
    need = policy.min_requests
    if canary.requests < need or baseline.requests < need:
        return Verdict(
            "wait",
            (f"{canary.requests} and {baseline.requests} requests of the {need} each needs",),
        )
    reasons = []
    if canary.error_rate() > policy.max_error_rate:
        reasons.append(
            f"error rate {canary.error_rate():.4f} > {policy.max_error_rate} "
            f"({canary.errors} of {canary.requests})"
        )
    ratio = canary.p99() / baseline.p99() if baseline.p99() > 0 else math.inf
    if not math.isnan(ratio) and ratio > policy.max_p99_ratio:
        reasons.append(
            f"p99 {canary.p99() * 1e3:.2f} ms is {ratio:.2f}x the baseline's "
            f"{baseline.p99() * 1e3:.2f} ms > {policy.max_p99_ratio}x"
        )
    if canary.compared and canary.mismatch_rate() > policy.max_mismatch_rate:
        reasons.append(
            f"mismatch rate {canary.mismatch_rate():.4f} > {policy.max_mismatch_rate} "
            f"({canary.mismatches} of {canary.compared} shadow answers differ)"
        )
    return Verdict("fail", tuple(reasons)) if reasons else Verdict("pass")
