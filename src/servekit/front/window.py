"""The Triton fronts' window: how many requests of one model are with tritonserver at once.

tritonserver runs what it was sent, whoever still waits for it: over HTTP it cannot be
told that a client left, and servekit's backend does not ask. So the front keeps the
queue itself: at most ``limit`` requests of a model are forwarded at a time (two full
batches per instance: one running, one forming, enough to keep the device busy), and
the rest wait here in arrival order. A request whose client leaves while it waits here
is dropped unsent (``where="queued"``); one that leaves after it was forwarded is
counted ``where="forwarded"`` and left to finish (tritonserver runs it anyway, as
servekit's backend does not ask ``is_cancelled``), so its slot is let go only when
tritonserver answers and the window always says what the device holds. With ``shed_late`` a request whose deadline falls before the
window's measured pace is refused at once (``batching.pace``), as the native batcher does.
The model's queue timeout (its own, or the KServe ``timeout`` its requests may set) runs
out here too: one that passes while its request waits fails it with ``DeadlineExceeded``
(504 / DEADLINE_EXCEEDED) unsent, as native's queue does, where tritonserver 2.51 runs
such a request all the same.

A model whose queue tritonserver must order itself (priority levels, a queue size, a
timeout that delays rather than rejects) gets no window: its requests go straight on.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from ..batching.pace import Pace, late
from ..batching.policy import BatchingPolicy, QueuePolicy, TimeoutAction
from ..batching.request import CLIENT_DEADLINE
from ..errors import DeadlineExceeded, ModelNotReady, ServekitError
from ..metrics import (
    ABANDONED_HELP,
    ABANDONED_METRIC,
    SHED_HELP,
    SHED_METRIC,
    TIMED_OUT_HELP,
    TIMED_OUT_METRIC,
    Family,
)
from .http import Answer, Done

__all__ = [
    "Slot",
    "Window",
    "due_s",
    "limit_from_triton",
    "limit_of",
    "queue_of_triton",
    "window_limit",
    "windows_figures",
]

log = logging.getLogger(__name__)

_WAITING, _SENT, _LEFT, _DONE, _EXPIRED = range(5)
T = TypeVar("T")


def _nothing() -> None:
    """What a slot that will never be sent is left holding."""


class Slot:
    """One request's place in a window: waiting, sent, left (its client gone), done, or
    expired (its queue timeout passed while it waited: ``fail`` told)."""

    __slots__ = ("fail", "go", "sent", "state", "timer")

    def __init__(
        self, go: Callable[[], None], fail: Callable[[ServekitError], None] | None
    ) -> None:
        self.go, self.fail, self.state, self.sent = go, fail, _WAITING, 0.0
        self.timer: asyncio.TimerHandle | None = None

    def settle(self, state: int) -> None:
        """It leaves the waiting line (``state``): its timeout no longer runs, and one
        that will never be sent lets its request go (it may wait in ``waiting`` a while)."""
        self.state = state
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if state in (_LEFT, _EXPIRED):
            self.go, self.fail = _nothing, None


class Window:
    """At most ``limit`` requests forwarded at once; the rest wait in arrival order.

    Runs on the front's event loop only (not thread-safe)."""

    def __init__(
        self, name: str, limit: int, *, shed_late: bool = False, queue: QueuePolicy | None = None
    ) -> None:
        if limit < 1:
            raise ValueError(f"{name}: a window holds at least one request, got {limit}")
        self.name, self.limit = name, limit
        self.queue = queue or QueuePolicy()
        """The model's queue policy: the timeout that runs out while a request waits here."""
        self.pace = Pace() if shed_late else None
        """The round trip of a forwarded request (tritonserver's queue and compute)."""
        self.sent = 0
        self.waiting: collections.deque[Slot] = collections.deque()
        self.queued = 0
        """Waiting here whose clients still wait (``waiting`` also holds those gone)."""
        self.abandoned_queued = 0
        self.abandoned_forwarded = 0
        self.shed = 0
        self.timed_out = 0
        self._draining = False

    def enter(
        self,
        go: Callable[[], None],
        due_s: float | None = None,
        *,
        timeout_us: int | None = None,
        fail: Callable[[ServekitError], None] | None = None,
    ) -> Slot:
        """``go`` is called (now, or once a forwarded request comes back) to send the
        request on; ``fail``, instead, if the queue's timeout for it (``timeout_us``: the
        request's own, where the policy lets it set one) passes while it waits here.
        Raises ``Shed`` where ``due_s`` (seconds its client still waits) falls before
        the expected answer."""
        # Never while nothing is forwarded: the request then runs and measures afresh (a
        # pace measured once too slow would otherwise shed everything for good).
        if self.pace is not None and due_s is not None and self.pace.service_s and self.sent:
            rtt = self.pace.service_s
            free = self.sent < self.limit and not self.queued
            expected = rtt if free else rtt * (1 + (self.queued + 1) / self.limit)
            if expected > due_s:
                self.shed += 1
                raise late(self.name, expected, due_s)
        slot = Slot(go, fail)
        if self.sent < self.limit and not self.queued:
            self._send(slot)
            return slot
        self.waiting.append(slot)
        self.queued += 1
        limit_us = self.queue.timeout_us(timeout_us)
        if limit_us and fail is not None:
            loop = asyncio.get_running_loop()
            slot.timer = loop.call_later(limit_us / 1e6, self._expire, slot, limit_us)
        return slot

    def _expire(self, slot: Slot, limit_us: int) -> None:
        fail = slot.fail
        if slot.state != _WAITING or fail is None:
            return
        slot.settle(_EXPIRED)
        self.queued -= 1
        self.timed_out += 1
        error = DeadlineExceeded(
            f"{self.name}: its queue timeout ({limit_us} us) passed while it waited in "
            "servekit's front; it was not run"
        )
        try:
            fail(error)
        except Exception:  # answering it failed: its connection's to log, never the loop's
            log.exception("%s: answering a request whose timeout passed failed", self.name)

    def leave(self, slot: Slot) -> None:
        """Its client left: dropped unsent if it still waits here, counted either way."""
        if slot.state == _WAITING:
            slot.settle(_LEFT)
            self.queued -= 1
            self.abandoned_queued += 1
        elif slot.state == _SENT:
            self.abandoned_forwarded += 1

    def done(self, slot: Slot) -> None:
        """The forwarded request is answered (or failed): the next waiting one goes."""
        if slot.state == _SENT:
            slot.state = _DONE
            self.sent -= 1
            if self.pace is not None:
                self.pace.ran(time.monotonic() - slot.sent)
        elif slot.state == _WAITING:  # failed before it was sent (the front stopping)
            slot.settle(_DONE)
            self.queued -= 1
        if self._draining:  # answered at once by a ``go`` below: that loop sends on
            return
        self._draining = True
        try:
            waiting = self.waiting
            while waiting and self.sent < self.limit:
                nxt = waiting.popleft()
                if nxt.state == _WAITING:
                    self.queued -= 1
                    self._send(nxt)
        finally:
            self._draining = False

    def _send(self, slot: Slot) -> None:
        slot.settle(_SENT)
        slot.sent = time.monotonic()
        self.sent += 1
        slot.go()  # never raises: ``send`` and ``wait`` answer their own failures

    def _unsend(self, slot: Slot) -> None:
        """A slot let go before its request was sent on (its waiter cancelled as it was
        woken): the client left while queued, and the slot goes to the next one."""
        slot.state = _LEFT
        self.sent -= 1
        self.abandoned_queued += 1
        self.done(slot)

    async def wait(self, due_s: float | None = None, timeout_us: int | None = None) -> Slot:
        """``enter`` for a coroutine: returns once the request may be sent (the caller
        calls ``done`` after); cancelled while waiting, it leaves; raises
        ``DeadlineExceeded`` if its queue timeout passes first."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def go() -> None:
            if not ready.done():
                ready.set_result(None)

        def fail(exc: ServekitError) -> None:
            if not ready.done():
                ready.set_exception(exc)

        slot = self.enter(go, due_s, timeout_us=timeout_us, fail=fail)
        try:
            await ready
        except asyncio.CancelledError:
            if slot.state == _SENT:  # woken, but cancelled before it could send
                self._unsend(slot)
            else:
                self.leave(slot)
            raise
        return slot

    async def through(
        self,
        sent: Callable[[], Awaitable[T]],
        due_s: float | None,
        held: set[Any],
        timeout_us: int | None = None,
    ) -> T:
        """``sent()`` once a slot is free; a client that leaves meanwhile does not cut it
        short: the request stays with tritonserver, which runs it anyway (servekit's
        backend does not ask ``is_cancelled`` yet), so its slot is let go only once it
        is answered (``held`` keeps the task until then)."""
        slot = await self.wait(due_s, timeout_us)
        task = asyncio.ensure_future(sent())
        held.add(task)
        task.add_done_callback(functools.partial(self._answered, slot, held))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.leave(slot)
            raise

    def _answered(self, slot: Slot, held: set[Any], task: asyncio.Future[Any]) -> None:
        held.discard(task)
        self.done(slot)
        if not task.cancelled():
            task.exception()  # its caller may have left: retrieved here, never logged as lost

    def send(
        self,
        go: Callable[[Done], None],
        done: Done,
        due_s: float | None,
        timeout_us: int | None = None,
    ) -> Callable[[], None] | None:
        """``through`` from callbacks: ``go(finish)`` sends the request once a slot is
        free and ``finish`` passes its answer to ``done``. Returns what to call if the
        client leaves first (None: already answered)."""
        slot: list[Slot] = []
        answered: list[bool] = []
        context = contextvars.copy_context()  # its own span, whichever callback sends it

        def finish(outcome: Answer | ServekitError) -> None:
            try:
                if slot:
                    self.done(slot[0])
                else:  # answered before ``enter`` returned
                    answered.append(True)
            finally:
                done(outcome)

        def start() -> None:
            try:
                context.run(go, finish)
            except ServekitError as exc:
                finish(exc)
            except Exception as exc:  # a bug sending it fails it, never the window
                log.exception("%s: sending a request on failed", self.name)
                finish(ModelNotReady(f"{self.name}: the front could not send it on: {exc}"))

        try:
            slot.append(self.enter(start, due_s, timeout_us=timeout_us, fail=done))
        except ServekitError as exc:
            done(exc)
            return None
        if answered:
            self.done(slot[0])
            return None
        return functools.partial(self.leave, slot[0])


def due_s(timeout_us: int | None) -> float | None:
    """Seconds the client still waits: its ``timeout`` parameter, its gRPC deadline."""
    due = timeout_us / 1e6 if timeout_us else None
    client = CLIENT_DEADLINE.get()
    if client is not None:
        left = client - time.monotonic()
        due = left if due is None else min(due, left)
    return due


def window_limit(max_batch_size: int, instances: int) -> int:
    """Two full batches per instance (one running, one forming); two requests per
    instance for a model that does not batch."""
    return 2 * max(max_batch_size, 1) * max(instances, 1)


def limit_of(policy: BatchingPolicy, model_max_batch_size: int, instances: int) -> int:
    """``limit_from_triton`` for a model servekit renders (PyTriton's): the same rule."""
    if policy.priority_levels > 1 or not _windowed(policy.default_queue_policy):
        return 0
    return window_limit(policy.effective_max_batch_size(model_max_batch_size), instances)


def _windowed(queue: QueuePolicy) -> bool:
    """Whether the front may keep this queue: no size to hold to, and any timeout one
    that rejects (the window fails the request; only tritonserver can delay it)."""
    timed = queue.default_timeout_us or queue.allow_timeout_override
    return not queue.max_queue_size and not (timed and queue.timeout_action is TimeoutAction.DELAY)


def queue_of_triton(config: Mapping[str, Any]) -> QueuePolicy:
    """The default queue policy of a model as tritonserver's config describes it."""
    queue = (config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    return QueuePolicy(
        max_queue_size=int(queue.get("max_queue_size") or 0),
        default_timeout_us=int(queue.get("default_timeout_microseconds") or 0),
        timeout_action=TimeoutAction(queue.get("timeout_action") or "REJECT"),
        allow_timeout_override=bool(queue.get("allow_timeout_override")),
    )


def limit_from_triton(config: Mapping[str, Any]) -> int:
    """The window for a model as tritonserver's config describes it; 0 (none) where its
    queue is tritonserver's to order: priority levels, a queue size, a timeout that
    delays."""
    if config.get("sequence_batching") or config.get("ensemble_scheduling"):
        return 0
    if (config.get("model_transaction_policy") or {}).get("decoupled"):
        return 0
    batching = config.get("dynamic_batching") or {}
    if int(batching.get("priority_levels") or 0) > 1 or batching.get("priority_queue_policy"):
        return 0
    if not _windowed(queue_of_triton(config)):
        return 0
    groups = config.get("instance_group") or [{}]
    instances = sum(int(g.get("count") or 1) for g in groups)
    return window_limit(int(config.get("max_batch_size") or 0), instances)


WAITING_METRIC = "servekit_front_waiting_requests"
WAITING_HELP = (
    "Requests waiting in servekit's front for a place in the model's window (two full "
    "batches per instance with tritonserver), not yet forwarded"
)


def windows_figures(windows: Callable[[], Iterable[Window]]) -> Callable[[], Iterable[Family]]:
    """The front's ``servekit_requests_abandoned_total`` (queued, forwarded),
    ``servekit_requests_shed_total``, ``servekit_requests_timed_out_total`` and the
    requests waiting of every window, for
    ``Metrics.collect``."""

    def figures() -> Iterable[Family]:
        ws = list(windows())
        labels = [{"model": w.name, "version": "1"} for w in ws]
        abandoned = [
            ({**lab, "where": where}, float(n))
            for w, lab in zip(ws, labels, strict=True)
            for where, n in (("queued", w.abandoned_queued), ("forwarded", w.abandoned_forwarded))
        ]
        shed = [(lab, float(w.shed)) for w, lab in zip(ws, labels, strict=True) if w.pace]
        timed_out = [(lab, float(w.timed_out)) for w, lab in zip(ws, labels, strict=True)]
        out: list[Family] = []
        if ws:
            waiting = [(lab, float(w.queued)) for w, lab in zip(ws, labels, strict=True)]
            out.append((WAITING_METRIC, "gauge", WAITING_HELP, waiting))
        if abandoned:
            out.append((ABANDONED_METRIC, "counter", ABANDONED_HELP, abandoned))
        if shed:
            out.append((SHED_METRIC, "counter", SHED_HELP, shed))
        if timed_out:
            out.append((TIMED_OUT_METRIC, "counter", TIMED_OUT_HELP, timed_out))
        return out

    return figures
