"""A queued request (typed and slotted, never a tuple) and its admission."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import itertools
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInput
from ..spec import ModelSpec
from ..tracing import CURRENT, traced
from .policy import BatchingPolicy
from .stats import BatcherStats

__all__ = ["CLIENT_DEADLINE", "Admission", "Request"]

Future = asyncio.Future | concurrent.futures.Future

CLIENT_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "servekit_client_deadline", default=None
)
"""When the client stops waiting (``time.monotonic``), where its protocol says so (a
gRPC call's ``grpc-timeout``): set by the server for the call's task."""


@dataclass(slots=True, eq=False)
class Request:
    """One caller's inputs plus what the scheduler needs to place them in a batch."""

    id: int
    inputs: Mapping[str, np.ndarray]
    rows: int
    shape_key: tuple[tuple[int, ...], ...]
    """Non-batch dims of every input, in spec order: equal keys may share a batch."""
    level: int
    arrival: float
    deadline: float
    """Absolute time (batcher clock) after which the queue policy's timeout applies; inf = none."""
    future: Future
    due: float = math.inf
    """When its client stops waiting (batcher clock): the earlier of its ``timeout``
    parameter (allowed to override the queue's or not) and its gRPC deadline; inf = none
    (``shed_late``)."""
    expired: bool = False
    """Timed out under ``TimeoutAction.DELAY``: now waits behind unexpired requests."""
    taken: bool = False
    """Removed from the queue into a batch (or failed, or dropped once its caller left)."""
    in_batch: bool = False
    """Launched in a batch: a caller leaving now no longer saves the device its rows."""
    abandoned: bool = False
    """Its caller stopped waiting (counted once, ``Batcher._abandoned``)."""
    started: float = 0.0
    """When its batch began to run (``time.monotonic``), on which instance, of how many rows."""
    instance: int = -1
    batch_rows: int = 0
    parent: str | None = None
    """Its span's ``traceparent`` where it is traced (``servekit.tracing``)."""
    steps: list[tuple[str, float, float]] | None = None
    """Its batch's pipeline steps (name, start, end), where it is traced."""

    def done(self) -> bool:
        return self.future.done()

    def resolve(self, outputs: dict[str, np.ndarray]) -> None:
        """Deliver outputs unless the caller already gave up (a cancelled future stays so)."""
        try:
            if not self.future.done():
                self.future.set_result(outputs)
        except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
            pass  # cancelled from another thread between the check and the set

    def fail(self, exc: BaseException) -> None:
        try:
            if not self.future.done():
                self.future.set_exception(exc)
        except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
            pass


class Admission:
    """The one place a request's inputs are validated: its rows against the policy's
    max batch size, its priority and timeout against the queue policy; then it becomes
    a ``Request`` stamped on the batcher's clock."""

    def __init__(
        self,
        spec: ModelSpec,
        policy: BatchingPolicy,
        name: str,
        clock: Callable[[], float],
        stats: BatcherStats,
    ) -> None:
        self.spec, self.policy, self.name, self._clock, self._stats = (
            spec,
            policy,
            name,
            clock,
            stats,
        )
        self._names = [t.name for t in spec.inputs]
        self._max_rows = policy.max_batch_size
        self._level = policy.level_of(0)
        self._timeout_us = policy.queue_policy(self._level).timeout_us(None)
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def __call__(
        self,
        inputs: Mapping[str, np.ndarray],
        priority: int,
        timeout_us: int | None,
        future: Future,
    ) -> Request:
        """Raises ``InvalidInput`` (counted) naming what is wrong."""
        level, timeout = self._level, self._timeout_us
        try:
            rows = self.spec.validate_inputs(inputs)
            if rows > self._max_rows:
                raise InvalidInput(
                    f"{self.name}: batch size {rows} exceeds max_batch_size {self._max_rows}"
                )
            if priority or timeout_us is not None:
                try:
                    level = self.policy.level_of(priority)
                except ValueError as exc:
                    raise InvalidInput(f"{self.name}: {exc}") from None
                timeout = self.policy.queue_policy(level).timeout_us(timeout_us)
        except InvalidInput:
            with self._lock:  # callers on any thread land here
                self._stats.request_invalid += 1
            raise
        now = self._clock()
        names = self._names
        shape_key = (
            (inputs[names[0]].shape[1:],)
            if len(names) == 1
            else tuple(inputs[n].shape[1:] for n in names)
        )
        deadline = now + timeout / 1e6 if timeout else math.inf
        due = now + timeout_us / 1e6 if timeout_us is not None and timeout_us > 0 else math.inf
        client = CLIENT_DEADLINE.get()
        if client is not None:
            due = min(due, now + client - time.monotonic())
        with self._lock:
            self._stats.request_admitted += 1
        request = Request(
            next(self._ids), inputs, rows, shape_key, level, now, deadline, future, due=due
        )
        if CURRENT.get() is not None:
            request.parent = traced()
        return request
