"""When queued requests run, and which together: the queue policy, the batching decision,
the free instances and one timer, all on the injected clock.

Runs on the batcher's event loop and nowhere else. Each wake-up (a request arrives, an
instance frees, the timer fires) expires timed-out requests, then starts batches while
``decide`` says so and an instance is free, then arms the timer for the earliest moment
anything can change: the decision's wait or the next queue deadline, both measured on
the injected clock. The loop only sleeps until then; a clock that has not reached the
moment (a test's fake clock) re-arms instead of running early.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from .ahead import Ahead
from .budget import Budget
from .decision import decide
from .pace import Pace, late
from .policy import BatchingPolicy, TimeoutAction
from .queue import RequestQueue
from .request import Request

__all__ = ["Scheduler"]


class Scheduler:
    """Dynamic batching's decisions for one model.

    Args:
        policy: the effective policy (``max_batch_size`` resolved).
        limit: rows one batch may hold.
        instance_count: batches that may run at once.
        clock: monotonic seconds; every decision and deadline is measured on it.
        launch: starts ``batch`` (already taken from the queue, an instance already
            claimed) at clock time ``now``.
        on_timeout: told how many queued requests ``expire`` just failed.
        ahead: hold a batch that would leave while the devices are busy until it is
            full or the oldest out is about to end (``batching.ahead``); None sends it
            once an instance is free.
        name: the model's, in a shed request's error.
    """

    def __init__(
        self,
        policy: BatchingPolicy,
        *,
        limit: int,
        instance_count: int,
        clock: Callable[[], float],
        launch: Callable[[list[Request], float], None],
        on_timeout: Callable[[int], None],
        ahead: Ahead | None = None,
        name: str = "model",
    ) -> None:
        self.queue = RequestQueue(policy)
        self.instance_count = instance_count
        self.free = instance_count
        self.flush = False
        """Closing: run what is queued without waiting for fuller batches."""
        self.drained: asyncio.Event | None = None
        """Set once nothing is queued or running (while closing)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._limit = limit
        self._preferred = frozenset(policy.preferred_batch_sizes)
        self._delay_s = policy.max_queue_delay_us / 1e6
        self._clock = clock
        self._launch = launch
        self._on_timeout = on_timeout
        self.ahead = ahead
        self.budget = (
            Budget(
                policy.latency_budget_ms / 1e3,
                policy.latency_percentile,
                limit=limit,
                instances=instance_count,
                clock=clock,
            )  # fmt: skip
            if policy.latency_budget_ms
            else None
        )
        """The latency budget's learned state (``batching.budget``), where one is set."""
        self.pace = Pace() if policy.shed_late else None
        """Its batches' compute time, what ``shed_late`` judges deadlines against."""
        self._name = name
        self._poke_pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = math.inf  # on the injected clock

    def admit(self, request: Request) -> None:
        """Queue ``request`` (or start it at once when nothing could join it).

        Raises:
            Overloaded: the queue is full.
            Shed: ``shed_late`` and the queue would answer it after its deadline.
        """
        if self.pace is not None and (request.due != math.inf or request.deadline != math.inf):
            self._shed_late(request)
        budget = self.budget
        if budget is not None:
            budget.arrived(request.rows, request.arrival)
        if (
            self.free
            and not self._delay_s
            and (
                budget is None or self.free == self.instance_count or budget.target <= request.rows
            )
            and self.queue.idle()
            and self._may_leave(request, request.arrival)
        ):
            # What decide() would do for a lone request with no delay, minus the queue round trip.
            request.taken = True
            self.free -= 1
            self._start([request], request.arrival)
            return
        self.queue.push(request)  # raises Overloaded
        if self.free and not self._delay_s and budget is None:
            self.poke()  # an idle instance and nothing to wait for: start now
        elif not self._poke_pending:
            # Coalesce: one decision per loop iteration however many requests arrive in it.
            self._poke_pending = True
            self.loop.call_soon(self.poke)  # type: ignore[union-attr]

    def release(self) -> None:
        """An instance finished its batch."""
        self.free += 1
        if self.ahead is not None:
            self.ahead.back(self._clock())
        self.poke()

    def poke(self) -> None:
        """Expire timeouts, then start batches while instances are free; arm the next wake-up."""
        self._poke_pending = False
        if self.drained is None and self.queue.idle():
            return
        now = self._clock()
        timed_out = self.queue.expire(now)
        if timed_out:
            self._on_timeout(timed_out)
        wait = math.inf
        while self.free:
            pending = self.queue.peek(self._limit + 1)
            if not pending:
                break
            if self.budget is not None:
                d = self.budget.decide(
                    pending, now, self.flush, busy=self.instance_count - self.free
                )
            else:
                d = decide(
                    pending,
                    now,
                    limit=self._limit,
                    preferred=self._preferred,
                    delay_s=self._delay_s,
                    flush=self.flush,
                )
            if not d.take:
                wait = d.wait_s if d.wait_s is not None else math.inf
                break
            batch = pending[: d.take]
            if self.ahead is not None and not self.flush:
                hold = self.ahead.may_leave(sum(r.rows for r in batch), now)
                if hold != 0.0:  # not yet: fuller once the batch running is nearly done
                    wait = hold if hold is not None else math.inf
                    break
            self.queue.take(batch)
            self.free -= 1
            self._start(batch, now)
        deadline = self.queue.next_deadline()
        if deadline is not None:
            wait = min(wait, max(deadline - now, 0.0))
        if wait < math.inf:
            self._arm(now, wait)
        if self.drained is not None and self.free == self.instance_count and not self.queue.peek(1):
            self.drained.set()

    def _shed_late(self, request: Request) -> None:
        """Raise ``Shed`` where the batches queued at or above its level, run on the
        instances at the measured compute time (half a batch more while every instance
        is busy), would answer ``request`` after its client's deadline, or start it
        after its queue timeout (REJECT's: DELAY's is no deadline)."""
        pace = self.pace
        assert pace is not None
        t = pace.service_s
        if not t or (self.free == self.instance_count and self.queue.idle()):
            return  # nothing measured, or idle: it runs now (and measures afresh)
        reject = self.queue.policy.queue_policy(request.level).timeout_action
        queue_left = (
            request.deadline - request.arrival if reject is TimeoutAction.REJECT else math.inf
        )
        left = min(request.due - request.arrival, queue_left + t)  # both until its answer
        if left == math.inf:
            return
        per_wave = self._limit * self.instance_count
        cap = (int(left / t) + 2) * per_wave  # rows past which it is late however counted
        rows = request.rows + self.queue.rows_ahead(request.level, cap)
        waves = math.ceil(math.ceil(rows / self._limit) / self.instance_count)
        expected = pace.answer_s(waves + (0.0 if self.free else 0.5))
        if expected > left:
            raise late(self._name, expected, left)

    def finished(self, batch: list[Request], compute_us: float) -> None:
        """A batch ran (before its instance is released): what the budget and the pace
        learn from."""
        if self.pace is not None:
            self.pace.ran(compute_us / 1e6)
        if self.budget is not None:
            now = self._clock()
            self.budget.ran(sum(r.rows for r in batch), compute_us / 1e6)
            self.budget.answered([now - r.arrival for r in batch], now)

    def _may_leave(self, request: Request, now: float) -> bool:
        return self.ahead is None or self.ahead.may_leave(request.rows, now) == 0.0

    def _start(self, batch: list[Request], now: float) -> None:
        if self.ahead is not None:
            self.ahead.sent(sum(r.rows for r in batch), now)
        self._launch(batch, now)

    def _arm(self, now: float, wait_s: float) -> None:
        due = now + wait_s
        if self._timer is not None:
            if self._timer_due <= due:
                return
            self._timer.cancel()
        self._timer = self.loop.call_later(wait_s, self._on_timer)  # type: ignore[union-attr]
        self._timer_due = due

    def _on_timer(self) -> None:
        self._timer, self._timer_due = None, math.inf
        self.poke()  # decides on the clock: not due yet there, it arms again

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_due = None, math.inf

    def __len__(self) -> int:
        return len(self.queue)
