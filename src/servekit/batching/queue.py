"""Queue policy: admission (max_queue_size), one queue per priority level, timeouts.

Walk order, as in Triton's priority queue: level 1's unexpired requests in arrival
order, then level 1's timed-out (DELAY) requests, then level 2, and so on. Requests
whose caller gave up are skipped and dropped lazily.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator

from ..errors import DeadlineExceeded, Overloaded
from .policy import BatchingPolicy, TimeoutAction
from .request import Request

__all__ = ["RequestQueue"]


class _Level:
    __slots__ = ("delayed", "live")

    def __init__(self) -> None:
        self.live: deque[Request] = deque()
        self.delayed: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self.live) + len(self.delayed)

    def purge(self) -> None:
        self.live = deque(r for r in self.live if not r.done())
        self.delayed = deque(r for r in self.delayed if not r.done())


class RequestQueue:
    """Holds waiting requests per priority level; not thread-safe (the batcher's loop owns it)."""

    def __init__(self, policy: BatchingPolicy) -> None:
        self.policy = policy
        self._levels = [_Level() for _ in range(policy.levels)]
        self._limits = [policy.queue_policy(i + 1).max_queue_size for i in range(policy.levels)]
        self._deadlines: list[tuple[float, int, Request]] = []

    def push(self, request: Request) -> None:
        """Enqueue, or raise ``Overloaded`` at once when the level's queue is full."""
        level = self._levels[request.level - 1]
        limit = self._limits[request.level - 1]
        if limit and len(level) >= limit:
            level.purge()
            if len(level) >= limit:
                raise Overloaded(
                    f"queue full: {len(level)} requests waiting at priority level "
                    f"{request.level} (max_queue_size {limit})"
                )
        level.live.append(request)
        if request.deadline != math.inf:
            heapq.heappush(self._deadlines, (request.deadline, request.id, request))

    def expire(self, now: float) -> int:
        """Apply timeouts due by ``now``: fail (REJECT) or demote (DELAY). Returns how many failed."""
        count = 0
        demoted: set[int] = set()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, r = heapq.heappop(self._deadlines)
            if r.taken or r.done():
                continue
            qp = self.policy.queue_policy(r.level)
            if qp.timeout_action is TimeoutAction.REJECT:
                count += 1
                r.taken = True
                r.fail(
                    DeadlineExceeded(
                        f"request timed out after {(now - r.arrival) * 1e6:.0f} us in the queue "
                        f"(timeout {(r.deadline - r.arrival) * 1e6:.0f} us); it was not run"
                    )
                )
            else:
                r.expired = True
                demoted.add(r.level)
        for lvl in demoted:
            level = self._levels[lvl - 1]
            level.delayed.extend(r for r in level.live if r.expired and not r.done())
            level.live = deque(r for r in level.live if not r.expired and not r.done())
        return count

    def next_deadline(self) -> float | None:
        """Earliest pending timeout, for the scheduler's timer."""
        while self._deadlines:
            _, _, r = self._deadlines[0]
            if r.taken or r.done() or r.expired:
                heapq.heappop(self._deadlines)
                continue
            return self._deadlines[0][0]
        return None

    def _walk(self) -> Iterator[Request]:
        for level in self._levels:
            for q in (level.live, level.delayed):
                while q and q[0].done():
                    q.popleft().taken = True
                for r in q:
                    if not r.done():
                        yield r

    def peek(self, max_requests: int) -> list[Request]:
        """The first ``max_requests`` waiting requests in walk order."""
        out: list[Request] = []
        for r in self._walk():
            out.append(r)
            if len(out) >= max_requests:
                break
        return out

    def take(self, requests: list[Request]) -> None:
        """Remove ``requests``, a prefix of the walk order (skipping dropped ones)."""
        wanted = {id(r) for r in requests}
        for level in self._levels:
            for q in (level.live, level.delayed):
                while q and wanted:
                    r = q.popleft()
                    r.taken = True
                    wanted.discard(id(r))
            if not wanted:
                return

    def take_all(self) -> list[Request]:
        """Remove and return every waiting request (for shutdown)."""
        out = [r for r in self._walk()]
        self.take(out)
        return out

    def rows_ahead(self, level: int, cap: int) -> int:
        """Rows waiting at ``level`` and above (what runs before a request of that level),
        counted up to ``cap`` at most (a long queue is not walked whole per request)."""
        rows = 0
        for lv in self._levels[:level]:
            for q in (lv.live, lv.delayed):
                for r in q:
                    if not r.done():
                        rows += r.rows
                        if rows >= cap:
                            return rows
        return rows

    def idle(self) -> bool:
        """True when no entry at all is queued (cheap; dropped entries count as queued)."""
        return not any(level.live or level.delayed for level in self._levels)

    def __len__(self) -> int:
        """Waiting requests whose callers still wait."""
        return sum(1 for _ in self._walk())
