"""The canary's verdict: a pure function of two versions' windows and the policy.

A window holds what one version did since the last verdict: requests, errors, latencies
and, where a shadow ran beside the answer, how many answers matched the baseline's.
No verdict before both versions have ``min_requests``; then the canary fails on each
limit it breaks beyond chance (``rollout.stats``: each reason named with its figures and
its p-value), else it passes.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any

from ..window import percentile
from .policy import CanaryPolicy
from .stats import more_errors_p, slower_p, tail_p

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
    alpha = 1 - policy.confidence
    if canary.error_rate() > policy.max_error_rate:
        p = more_errors_p(canary.errors, canary.requests, baseline.errors, baseline.requests)
        if p < alpha:
            reasons.append(
                f"error rate {canary.error_rate():.4f} > {policy.max_error_rate} "
                f"({canary.errors} of {canary.requests}; the baseline's "
                f"{baseline.error_rate():.4f}, p {_p(p)})"
            )
    p99, base = canary.p99(), baseline.p99()
    ratio = p99 / base if base > 0 else math.inf
    increase_ms = (p99 - base) * 1e3
    if (
        not math.isnan(ratio)
        and ratio > policy.max_p99_ratio
        and increase_ms > policy.max_p99_increase_ms
    ):
        c, b = list(canary.latencies), list(baseline.latencies)
        p = min(1.0, 2 * min(slower_p(c, b), tail_p(c, b)))  # either test, Bonferroni
        if p < alpha:
            reasons.append(
                f"p99 {p99 * 1e3:.2f} ms is {ratio:.2f}x the baseline's {base * 1e3:.2f} ms "
                f"> {policy.max_p99_ratio}x (+{increase_ms:.2f} ms; slower with p {_p(p)})"
            )
    if canary.compared and canary.mismatch_rate() > policy.max_mismatch_rate:
        reasons.append(
            f"mismatch rate {canary.mismatch_rate():.4f} > {policy.max_mismatch_rate} "
            f"({canary.mismatches} of {canary.compared} shadow answers differ)"
        )
    return Verdict("fail", tuple(reasons)) if reasons else Verdict("pass")


def _p(p: float) -> str:
    return "< 0.0001" if p < 1e-4 else f"{p:.4f}"
