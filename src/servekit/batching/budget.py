"""Batching that holds a latency budget by itself (``[models.batching] latency_budget_ms``).

In place of a fixed queue delay and preferred sizes, each batch is chosen from what the
batcher has learned online (as Clipper adapts its batches to a latency objective):

- the batch time per size, a line fitted to every batch run (recent batches weigh most),
  scaled by the ``latency_percentile`` of how far batches ran over the line;
- the arrival rate, in rows per second, smoothed over about a second;
- how many requests were answered within the budget lately.

From these: the *target* is the fewest rows a batch needs for the instances to keep up
with the arrivals, with ``HEADROOM`` to spare (1 at a light load). A free instance takes
what waits at once when the device is idle (no other instance running: holding rows then
never serves more of them, and batches grow by themselves as the load does), or when the
target's rows wait. Otherwise it holds them only while the oldest can still be answered
within the budget after a batch of the target, and no longer than the target takes to
arrive (``decide_within``). When requests miss the budget regardless, the budget the
holds use shrinks (by a tenth a step) and grows back slowly once they stop. Past what one
replica can serve within the budget, ``replicas_needed`` asks for more replicas rather
than smaller batches.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .decision import Decision
from .request import Request

__all__ = ["HEADROOM", "BatchTimes", "Budget", "decide_within"]

HEADROOM = 0.85
"""The share of the instances' rate at the target size the arrivals may take."""
_DECAY = 0.97
"""Weight left to a batch's time after each newer batch (about the last 30 count)."""
_RATE_TAU_S = 1.0
"""The arrival rate's smoothing time."""
_ADAPT_EVERY_S = 0.5
"""How often the budget the decisions use is adjusted."""
_PLAN_EVERY_S = 0.01
"""How often the target is worked out again."""
_ANSWERS_KEPT = 512
"""Answers the attainment is counted over (and no older than ``_ANSWERS_S``)."""
_ANSWERS_S = 10.0
_BATCHES_KEPT = 64
"""Batches the mean rows per batch (``batch_rows``) is taken over."""


class BatchTimes:
    """Seconds a batch takes per rows: a line fitted by exponentially weighted least
    squares, never decreasing in rows, and the ``percentile`` of time over the line."""

    def __init__(self, percentile: float = 99.0, kept: int = 256) -> None:
        self.percentile = percentile
        self._sums = [0.0] * 5  # weights, rows, rows^2, seconds, rows*seconds
        self._ratios: deque[float] = deque(maxlen=kept)
        self._scale = 1.0
        self._since_scale = 0

    @property
    def known(self) -> bool:
        return self._sums[0] > 0

    def observe(self, rows: int, seconds: float) -> None:
        """A batch of ``rows`` took ``seconds``."""
        predicted = self.mean(rows)
        if predicted is not None and predicted > 0:
            self._ratios.append(seconds / predicted)
            self._since_scale += 1
            if self._since_scale >= 8 or len(self._ratios) < 8:
                self._scale = self._quantile()
                self._since_scale = 0
        w, b, bb, t, bt = (s * _DECAY for s in self._sums)
        self._sums = [w + 1, b + rows, bb + rows * rows, t + seconds, bt + rows * seconds]

    def _quantile(self) -> float:
        ordered = sorted(self._ratios)
        rank = max(math.ceil(self.percentile / 100 * len(ordered)) - 1, 0)
        return max(ordered[rank], 1.0)

    def mean(self, rows: int) -> float | None:
        """The line at ``rows`` (None before any batch). With one size seen so far, the
        time is taken to grow in proportion to rows above it (an upper bound)."""
        w, b, bb, t, bt = self._sums
        if w <= 0:
            return None
        mean_rows, mean_t = b / w, t / w
        spread = bb / w - mean_rows * mean_rows
        if spread <= 1e-9 * max(mean_rows * mean_rows, 1.0):
            return mean_t * max(rows / mean_rows, 1.0)
        slope = max((bt / w - mean_rows * mean_t) / spread, 0.0)
        intercept = max(mean_t - slope * mean_rows, 0.0)
        return intercept + slope * rows

    def at_percentile(self, rows: int) -> float | None:
        """The time a batch of ``rows`` stays within at the percentile."""
        mean = self.mean(rows)
        return None if mean is None else mean * self._scale


class Budget:
    """One model's latency budget: what ``decide_within`` is given, learned as it serves.

    Told of each request's arrival (``arrived``), each batch's time (``ran``) and each
    answer's time in the server (``answered``), on the batcher's clock."""

    def __init__(
        self,
        budget_s: float,
        percentile: float,
        *,
        limit: int,
        instances: int = 1,
        clock: Callable[[], float],
    ) -> None:
        if budget_s <= 0:
            raise ValueError(f"latency budget must be > 0, got {budget_s}")
        self.budget_s, self.percentile = budget_s, percentile
        self.limit, self.instances = limit, instances
        self.times = BatchTimes(percentile)
        self._clock = clock
        self._rate = 0.0
        self._rate_at: float | None = None
        self._answers: deque[tuple[float, bool]] = deque(maxlen=_ANSWERS_KEPT)
        self.working_s = budget_s
        """The budget the decisions use: the budget, less what misses taught."""
        self._adapted_at = -math.inf
        self.target = 1
        """The fewest rows a free instance holds a batch for while another instance runs
        one: the fewest that keep up with the arrivals (an idle server sends at once)."""
        self._rows: deque[int] = deque(maxlen=_BATCHES_KEPT)
        self._planned_at = -math.inf
        self.held_s = 0.0
        """How long the oldest request of the last batch waited for it to leave."""

    # ------------------------------------------------------------------ learning

    def arrived(self, rows: int, now: float) -> None:
        self._rate = self.rate(now) + rows / _RATE_TAU_S
        self._rate_at = now

    def rate(self, now: float) -> float:
        """Rows a second arriving, smoothed over about ``_RATE_TAU_S``."""
        if self._rate_at is None:
            return 0.0
        return self._rate * math.exp(-max(now - self._rate_at, 0.0) / _RATE_TAU_S)

    def ran(self, rows: int, seconds: float) -> None:
        self.times.observe(rows, seconds)
        self._rows.append(rows)

    def batch_rows(self) -> float | None:
        """Mean rows of the last ``_BATCHES_KEPT`` batches run (None before any): every
        batch takes all that waits, up to the limit, so at a load it passes the target."""
        rows = tuple(self._rows)  # one C call: a scrape may read from another thread
        return sum(rows) / len(rows) if rows else None

    def answered(self, latencies_s: Sequence[float], now: float) -> None:
        """Requests answered now after ``latencies_s`` each in the server."""
        for latency in latencies_s:
            self._answers.append((now, latency <= self.budget_s))
        if now - self._adapted_at < _ADAPT_EVERY_S:
            return
        self._adapted_at = now
        attained = self.attainment(now)
        if attained is None:
            return
        if attained < self.percentile / 100:
            self.working_s = max(self.working_s * 0.9, self.budget_s * 0.2)
        else:
            self.working_s = min(self.working_s + 0.02 * self.budget_s, self.budget_s)

    def attainment(self, now: float) -> float | None:
        """The share of the recent answers within the budget (None: none lately)."""
        answers = tuple(self._answers)  # one C call: a scrape may read from another thread
        recent = [ok for at, ok in answers if now - at <= _ANSWERS_S]
        return sum(recent) / len(recent) if recent else None

    # ------------------------------------------------------------------ deciding

    def rows_within(self) -> int:
        """The most rows a batch may hold within the budget: ``limit``, or fewer where a
        batch would take more than half the budget (a request may wait for the batch
        before its own)."""
        if not self.times.known:
            return self.limit
        best = 1
        for rows in range(1, self.limit + 1):
            t = self.times.at_percentile(rows)
            if t is not None and t <= self.budget_s / 2:
                best = rows
        return best

    def target_rows(self, now: float, most: int) -> int:
        """The fewest rows (up to ``most``) whose batches keep up with the arrivals, with
        ``HEADROOM`` where any size has it, else without."""
        rate = self.rate(now)
        for need in (rate / HEADROOM, rate):
            for rows in range(1, most + 1):
                t = self.times.mean(rows)
                if t is None or self.instances * rows / max(t, 1e-9) >= need:
                    return rows
        return most

    def decide(
        self, pending: Sequence[Request], now: float, flush: bool = False, busy: int = 0
    ) -> Decision:
        """The next batch for a free instance while ``busy`` others run one. With none
        running, whatever waits leaves at once: holding rows while the device idles never
        serves more of them (batches then grow by themselves with the load)."""
        if now - self._planned_at >= _PLAN_EVERY_S:
            self._planned_at = now
            self.target = self.target_rows(now, self.limit)
        rate = self.rate(now)
        d = decide_within(
            pending,
            now,
            limit=self.limit,
            budget_s=self.working_s,
            target=self.target if busy else 1,
            batch_s=self.times.at_percentile,
            fill_s=(self.target - 1) / rate if rate > 0 else 0.0,
            flush=flush,
        )
        if d.take:
            self.held_s = max(now - min(r.arrival for r in pending[: d.take]), 0.0)
        return d

    def figures(self) -> dict[str, float]:
        """What it chose and how it fares, now: the budget and the part of it the holds
        use, the share of recent answers within it (while there are any), the target rows,
        the rows the recent batches held (once any ran) and the last batch's hold."""
        now = self._clock()
        out = {
            "budget_s": self.budget_s,
            "working_s": self.working_s,
            "target_rows": float(self.target),
            "held_s": self.held_s,
        }
        attained = self.attainment(now)
        if attained is not None:
            out["attainment"] = attained
        rows = self.batch_rows()
        if rows is not None:
            out["batch_rows"] = rows
        return out

    def replicas_needed(self, now: float | None = None) -> float:
        """Replicas of this model that the arrivals need within the budget: the rate over
        what one replica serves at ``HEADROOM`` with batches held to the budget."""
        rate = self.rate(self._clock() if now is None else now)
        if rate <= 0:
            return 0.0
        rows = self.rows_within()
        t = self.times.mean(rows)
        if t is None:
            return 0.0
        return rate / (HEADROOM * self.instances * rows / max(t, 1e-9))


@dataclass(frozen=True)
class _Walk:
    take: int
    rows: int
    oldest: float
    full: bool


def _walk(pending: Sequence[Request], limit: int) -> _Walk:
    rows = n = 0
    shape = pending[0].shape_key
    oldest = pending[0].arrival
    for r in pending:
        if n and (rows + r.rows > limit or r.shape_key != shape):
            return _Walk(n, rows, oldest, True)
        rows += r.rows
        n += 1
        oldest = min(oldest, r.arrival)
        if rows >= limit:
            return _Walk(n, rows, oldest, True)
    return _Walk(n, rows, oldest, False)


def decide_within(
    pending: Sequence[Request],
    now: float,
    *,
    limit: int,
    budget_s: float,
    target: int,
    batch_s: Callable[[int], float | None],
    fill_s: float = math.inf,
    flush: bool = False,
) -> Decision:
    """The next batch for a free instance under a latency budget: every request that
    waits (up to ``limit`` rows) once ``target`` rows wait, the batch can grow no more,
    ``fill_s`` (the time the rest of ``target`` rows take to arrive) has passed since the oldest
    came, or holding longer would leave the oldest request past ``budget_s`` after a
    batch of ``target`` rows (``batch_s``: the time a batch of so many rows takes; None,
    not known yet: send now). Otherwise wait, at most until the first of those moments."""
    if not pending:
        return Decision(0)
    walk = _walk(pending, limit)
    if walk.full or flush or walk.rows >= target:
        return Decision(walk.take)
    t = batch_s(max(target, walk.rows))
    if t is None:
        return Decision(walk.take)
    latest = walk.oldest + min(budget_s - t, fill_s)
    if now >= latest - 1e-9:
        return Decision(walk.take)
    return Decision(0, latest - now)
