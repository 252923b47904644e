"""How ``servekit tune`` searches: constraints, the score of a measured candidate, and
the two strategies (brute: every point; quick: a hill climb, as Model Analyzer's quick
search), both over any ``evaluate`` that measures one point.

A candidate is measured at several client concurrencies; its figure is the best point
that meets the constraints (p99 budget, minimum throughput, no errors), as Model
Analyzer reports a configuration by its best measurement under the constraints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..bench.loadgen import Point
from .space import Knobs, SearchSpace

__all__ = ["Constraints", "Trial", "best_trial", "brute", "quick"]

OBJECTIVES = ("throughput", "latency")


@dataclass(frozen=True)
class Constraints:
    """What a measurement must meet to count, and what is maximised among those that do."""

    p99_ms: float | None = None
    min_throughput: float | None = None
    """Rows (inferences) per second."""
    objective: str = "throughput"
    """``throughput`` (highest rows/s) or ``latency`` (lowest p99)."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {list(OBJECTIVES)}, got {self.objective!r}")
        for name in ("p99_ms", "min_throughput"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")

    def violations(self, point: Point) -> list[str]:
        """What ``point`` misses, in words; empty when it counts."""
        s, out = point.stats, []
        if s.errors:
            out.append(f"{s.errors} errors")
        if s.requests == 0:
            out.append("no answers")
        if self.p99_ms is not None and not s.p99_ms <= self.p99_ms:
            out.append(f"p99 {s.p99_ms:.1f} ms > {self.p99_ms:g} ms")
        if self.min_throughput is not None and s.inferences_per_s < self.min_throughput:
            out.append(f"throughput {s.inferences_per_s:.1f}/s < {self.min_throughput:g}/s")
        return out

    def value(self, point: Point) -> float:
        """Higher is better."""
        if self.objective == "latency":
            return -point.stats.p99_ms
        return point.stats.inferences_per_s

    def shortfall(self, point: Point) -> float:
        """How far ``point`` is from meeting the constraints (0 when it does), so that a
        climb from an infeasible start moves toward feasibility."""
        s, worst = point.stats, 0.0
        if s.errors or s.requests == 0:
            return math.inf
        if self.p99_ms is not None:
            worst = max(worst, s.p99_ms / self.p99_ms - 1)
        if self.min_throughput is not None:
            worst = max(worst, self.min_throughput / max(s.inferences_per_s, 1e-9) - 1)
        return worst


@dataclass
class Trial:
    """One candidate, measured (or not)."""

    knobs: Knobs
    points: list[Point] = field(default_factory=list)
    status: str = "ok"
    """``ok`` (a point met the constraints), ``pruned`` (none did), ``failed`` (the
    runtime did not start or answer) or ``interrupted``."""
    reason: str = ""
    """Why it was pruned or failed."""
    best: Point | None = None
    """Its best point under the constraints."""
    peak_rss_mb: float = math.nan
    """Peak resident memory of the server's whole process tree."""
    seconds: float = 0.0

    def judge(self, constraints: Constraints) -> Trial:
        """Set ``best``, ``status`` and ``reason`` from the points; returns self."""
        if self.status in ("failed", "interrupted"):
            return self
        meeting = [p for p in self.points if not constraints.violations(p)]
        if meeting:
            self.best = max(meeting, key=constraints.value)
            self.status, self.reason = "ok", ""
        else:
            self.best = None
            self.status = "pruned"
            self.reason = (
                "; ".join(
                    f"concurrency {p.level:g}: {', '.join(constraints.violations(p))}"
                    for p in self.points
                )
                or "nothing measured"
            )
        return self

    def score(self, constraints: Constraints) -> tuple[int, float]:
        """Comparable: feasible trials by the objective, others by their shortfall."""
        if self.best is not None:
            return (1, constraints.value(self.best))
        if not self.points:
            return (0, -math.inf)
        return (0, -min(constraints.shortfall(p) for p in self.points))


Evaluate = Callable[[Knobs], Trial]


def brute(space: SearchSpace, evaluate: Evaluate) -> list[Trial]:
    """Every point of the space, in grid order."""
    return [evaluate(space.knobs(i)) for i in space.indices()]


def quick(
    space: SearchSpace,
    evaluate: Evaluate,
    constraints: Constraints,
    *,
    start: Sequence[int] | None = None,
    min_gain: float = 0.02,
) -> list[Trial]:
    """Hill climb from ``start`` (default: every knob at its lowest), knob by knob in
    ``KNOBS``' order: step along a knob while each step beats the current point by more
    than ``min_gain`` (noise), up first, then down. Then every neighbour of the point
    reached is measured; if one beats it the climb goes on from there, else it stops:
    the result is a local optimum of the space, found without measuring most of it."""
    trials: dict[tuple[int, ...], Trial] = {}

    def measured(index: tuple[int, ...]) -> Trial:
        if index not in trials:
            trials[index] = evaluate(space.knobs(index))
        return trials[index]

    def better(a: Trial, b: Trial) -> bool:
        (fa, va), (fb, vb) = a.score(constraints), b.score(constraints)
        if fa != fb:
            return fa > fb
        if fa == 0:
            return va > vb
        return va > vb + abs(vb) * min_gain

    def step(index: tuple[int, ...], axis: int, by: int) -> tuple[int, ...] | None:
        moved = index[axis] + by
        if not 0 <= moved < space.shape[axis]:
            return None
        return (*index[:axis], moved, *index[axis + 1 :])

    current = tuple(start) if start is not None else (0,) * len(space.shape)
    while True:
        for axis in range(len(space.shape)):
            for by in (1, -1):
                moved = False
                while (nxt := step(current, axis, by)) is not None:
                    here = measured(current)  # measured before its neighbour, as reported
                    if not better(measured(nxt), here):
                        break
                    current, moved = nxt, True
                if moved:
                    break
        here = measured(current)
        improved = [n for n in space.neighbours(current) if better(measured(n), here)]
        if not improved:
            return list(trials.values())
        current = improved[0]


def best_trial(trials: Sequence[Trial], constraints: Constraints) -> Trial | None:
    """The trial that met the constraints with the best objective, if any did."""
    ok = [t for t in trials if t.best is not None]
    return max(ok, key=lambda t: constraints.value(t.best)) if ok else None  # type: ignore[arg-type]
