"""The Batcher: Triton-style dynamic batching in front of any Runner, for asyncio and threads.

It admits requests (validation, priority, timeout), and delivers each batch's results to
their callers, in order when the policy says so. Its parts: ``Scheduler`` (the queue
policy, the decision and the timer, on the injected clock), ``LoopBridge`` (the loop it
schedules on and the way in for threads) and ``Instances`` (where batches execute, through
the one path in ``execute``). Requests pay only validation, a deque append and their future.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from enum import Enum
from typing import Any, cast

import numpy as np

from .. import tracing
from ..errors import (
    DeadlineExceeded,
    ModelNotReady,
    Overloaded,
    RunnerError,
    Shed,
)
from ..runners.base import Runner, batch_function, staging_of
from ..runners.broken import broken
from ..spec import ModelSpec
from .ahead import Ahead
from .bridge import LoopBridge
from .budget import Budget
from .delivery import Delivery
from .execute import BatchFn, Fit, Steps, batch_steps
from .instances import Instances
from .policy import BatchingPolicy
from .request import Admission, Request
from .scheduler import Scheduler
from .stats import BatcherStats, BatchRecord

__all__ = ["Batcher"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class _State(Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Batcher:
    """Groups concurrent requests into batches for a Runner, with Triton's semantics.

    Args:
        runner: a Runner, or a batch function ``dict -> dict`` (then ``spec`` is required).
        policy: batching and queue policy; ``max_batch_size`` 0 takes the model's.
        spec: the model signature, when ``runner`` is a plain function.
        instance_count: batches that may execute concurrently (Triton's instance_group count).
        clock: monotonic seconds; injectable for tests (every delay and timeout is on it).
        name: used in thread names and error messages.
        listeners: called with a ``BatchRecord`` after each batch (metrics).
        executor: where batches run. ``"threads"`` (default): ``instance_count`` worker
            threads, for engines that release the GIL. ``"loop"``: on the event loop
            itself, as Ray's ``@serve.batch`` does: no thread hop, for batch functions
            that take microseconds or are coroutines (awaited there, ``instance_count``
            at a time). Coroutine functions always run on the loop.
        require_finite: a batch whose floating-point outputs hold NaN or Inf fails, whole,
            with a ``RunnerError`` naming the model and the output (a 500 on the servers),
            instead of handing those values to the callers.
        ahead: the batch function hands batches to this many devices elsewhere, each
            running one at a time (Ray's ingress: the model's replicas); with every
            device busy, the next batch leaves only when full or just before the oldest
            out is expected back (``batching.ahead``), so it holds everything that
            queued meanwhile. 0 (default): each batch leaves once an instance is free.

    Inputs are validated once, here, as each request is admitted; outputs are checked
    once, here, for each batch (a ``BaseRunner`` is called through ``run``, which does
    neither again).
    """

    def __init__(
        self,
        runner: Any,
        policy: BatchingPolicy | None = None,
        *,
        spec: ModelSpec | None = None,
        instance_count: int = 1,
        clock: Callable[[], float] = time.monotonic,
        name: str = "model",
        listeners: Iterable[Callable[[BatchRecord], None]] = (),
        executor: str | None = None,
        require_finite: bool = False,
        ahead: int = 0,
    ) -> None:
        self.require_finite = require_finite
        fn: BatchFn
        if isinstance(runner, Runner):
            fn, spec = batch_function(runner), spec or runner.spec
        elif callable(runner):
            if spec is None:
                raise TypeError("Batcher(fn) needs spec= when fn is a plain function")
            fn = runner
        else:
            raise TypeError(f"expected a Runner or a callable, got {type(runner).__name__}")
        assert spec is not None
        if not spec.batched:
            raise ValueError(f"{name}: dynamic batching needs max_batch_size > 0 in the model spec")
        policy = policy or BatchingPolicy()
        try:
            effective = policy.effective_max_batch_size(spec.max_batch_size)
        except ValueError as exc:
            raise ValueError(f"{name}: policy {exc}") from None
        policy = replace(policy, max_batch_size=effective)
        is_async = asyncio.iscoroutinefunction(fn)
        if executor is None:
            executor = "loop" if is_async else "threads"
        if executor not in ("threads", "loop"):
            raise ValueError(f"executor must be 'threads' or 'loop', got {executor!r}")
        if is_async and executor == "threads":
            raise ValueError(f"{name}: a coroutine batch function must run with executor='loop'")
        if instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {instance_count}")
        self.executor = executor
        self.spec, self.policy, self.name = spec, policy, name
        self.instance_count = instance_count
        self.stats = BatcherStats()
        self.listeners = list(listeners)
        self._names = [t.name for t in spec.inputs]
        self.runner: Runner | None = runner if isinstance(runner, Runner) else None
        """The runner batches go to (None: a plain batch function)."""
        self._staging = staging_of(runner, spec)
        self._fit = Fit()
        self._request = Admission(spec, policy, name, clock, self.stats)
        self._state = _State.OPEN
        self._scheduler = Scheduler(
            policy,
            limit=policy.batch_limit(spec.max_batch_size),
            instance_count=instance_count,
            clock=clock,
            launch=self._launch,
            on_timeout=self._count_timeouts,
            ahead=Ahead(policy.batch_limit(spec.max_batch_size), ahead) if ahead else None,
            name=name,
        )
        self._delivery = Delivery(
            name,
            self.stats,
            self.listeners,
            ordered=policy.preserve_ordering,
            release=self._scheduler.release,
            finished=self._scheduler.finished,
        )
        self._bridge = LoopBridge(name, self._admit_from_thread)
        self._bridge.on_bind = self._on_bind
        self._instances = Instances(
            fn,
            count=instance_count,
            name=name,
            executor=executor,
            steps=self._steps,
            complete=self._delivery.complete,
            call_soon=self._bridge.call_soon,
        )

    # ---------------------------------------------------------------- callers

    async def infer(
        self, inputs: Mapping[str, np.ndarray], *, priority: int = 0, timeout_us: int | None = None
    ) -> Arrays:
        """Queue one request (one or more rows) and await its outputs.

        Raises:
            InvalidInput: the inputs do not match the spec, or the priority is out of range.
            Overloaded: the queue is full (raised at once).
            DeadlineExceeded: the request's timeout passed while it waited (REJECT).
            ModelNotReady: the batcher is closing or closed.
            RunnerError: the model failed on the batch holding this request.
        """
        loop = asyncio.get_running_loop()
        if self._bridge.loop is not loop and not self._bridge.bind(loop):
            request = self._submit_threadsafe(inputs, priority, timeout_us)
            try:
                return await asyncio.wrap_future(request.future)  # type: ignore[no-any-return]
            except asyncio.CancelledError:
                request.future.cancel()
                self._bridge.call_soon(self._abandoned, request)
                raise
        if self._state is not _State.OPEN:
            raise ModelNotReady(f"{self.name}: batcher is {self._state.value}")
        request = self._request(inputs, priority, timeout_us, loop.create_future())
        self._admit(request)
        try:
            outputs = await request.future  # type: ignore[misc]
        except asyncio.CancelledError:
            # The caller left (its client closed, its call was cancelled): still queued,
            # the cancelled future is skipped by every batch formed from now on.
            self._abandoned(request)
            raise
        if tracing.CURRENT.get() is not None and request.started:
            tracing.batched(
                request.arrival, request.started, request.batch_rows, request.instance,
                request.steps,
            )  # fmt: skip
        return outputs  # type: ignore[no-any-return]

    def infer_sync(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        wait_s: float | None = None,
    ) -> Arrays:
        """Blocking ``infer`` for threaded callers; thread-safe.

        ``wait_s`` bounds how long this caller waits; on expiry the request is cancelled
        (dropped if it has not started) and ``DeadlineExceeded`` is raised.
        """
        if self._bridge.on_own_loop():
            raise RuntimeError(
                "infer_sync would block the batcher's own event loop; use `await batcher.infer()`"
            )
        request = self._submit_threadsafe(inputs, priority, timeout_us)
        fut = cast(concurrent.futures.Future, request.future)
        try:
            return fut.result(wait_s)  # type: ignore[no-any-return]
        except concurrent.futures.TimeoutError:
            if fut.cancel():
                self._bridge.call_soon(self._abandoned, request)
            raise DeadlineExceeded(f"{self.name}: no result within {wait_s} s") from None

    async def aclose(self, drain: bool = True) -> None:
        """Stop accepting; run (``drain``) or fail every queued request; wait for running batches."""
        self._bridge.stop_accepting()
        loop = self._bridge.running()
        if loop is not None:
            if asyncio.get_running_loop() is loop:
                await self._close_on_loop(drain)
            else:
                cf = asyncio.run_coroutine_threadsafe(self._close_on_loop(drain), loop)
                await asyncio.wrap_future(cf)
        self._finish_close()

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Blocking ``aclose`` for threaded callers (not from the batcher's own loop)."""
        if self._bridge.on_own_loop():
            raise RuntimeError(
                "close() would block the batcher's event loop; use `await batcher.aclose()`"
            )
        self._bridge.stop_accepting()
        loop = self._bridge.running()
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._close_on_loop(drain), loop).result(timeout_s)
        self._finish_close()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Batcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    @property
    def fitted_rows(self) -> int:
        """The most rows a batch holds since the device ran out of memory (0: no limit)."""
        return self._fit.rows

    @property
    def broken(self) -> str | None:
        """Why no instance can serve (``runners.broken``): the device was lost
        (``device lost: ...``) or the runner says so (its set-up failed); None while it can."""
        return self._fit.lost or broken(self.runner)

    @property
    def device_lost(self) -> str | None:
        """``device lost: <CUDA's words>`` once a batch raised a sticky CUDA error."""
        return self._fit.lost

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes the runner's staging holds (0 on the host)."""
        return self._staging.pinned_bytes

    @property
    def budget(self) -> Budget | None:
        """The latency budget's learned state (``latency_budget_ms``), where one is set."""
        return self._scheduler.budget

    @property
    def pending(self) -> int:
        """Requests waiting in the queue (Triton's ``nv_inference_pending_request_count``)."""
        return len(self._scheduler)

    # ------------------------------------------------------------ admission

    def _admit(self, request: Request) -> None:
        try:
            self._scheduler.admit(request)
        except Shed:
            self.stats.request_shed += 1
            self.stats.request_failure += 1
            raise
        except Overloaded:
            self.stats.request_rejected += 1
            self.stats.request_failure += 1
            raise

    def _admit_from_thread(self, request: Request) -> None:
        if self._state is not _State.OPEN:
            request.fail(ModelNotReady(f"{self.name}: batcher is {self._state.value}"))
            return
        try:
            self._admit(request)
        except Overloaded as exc:
            request.fail(exc)

    def _submit_threadsafe(
        self, inputs: Mapping[str, np.ndarray], priority: int, timeout_us: int | None
    ) -> Request:
        request = self._request(inputs, priority, timeout_us, concurrent.futures.Future())
        self._bridge.submit(request)
        return request

    def _on_bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduler.loop = loop

    def _abandoned(self, request: Request) -> None:
        """Count, once, a request whose caller stopped waiting: where it was decides
        whether the device was spared (queued) or ran it for nobody (running)."""
        if request.abandoned:
            return
        request.abandoned = True
        self.stats.request_cancelled += 1
        if request.in_batch:
            self.stats.abandoned_running += 1
        else:
            self.stats.abandoned_queued += 1

    def _count_timeouts(self, n: int) -> None:
        self.stats.request_timeout += n
        self.stats.request_failure += n

    # ------------------------------------------------------------ execution

    def _launch(self, batch: list[Request], now: float) -> None:
        for r in batch:
            r.in_batch = True
        queue_us = tuple((now - r.arrival) * 1e6 for r in batch)
        seq = self._delivery.number()
        self._instances.launch(self._bridge.loop, seq, batch, queue_us)  # type: ignore[arg-type]

    def _steps(self, batch: list[Request]) -> Steps:
        return batch_steps(
            [r.inputs for r in batch],
            [r.rows for r in batch],
            self._names,
            self._check,
            self.name,
            self._staging,
            self._fit,
        )

    def _check(self, outputs: Mapping[str, np.ndarray], rows: int) -> None:
        """The one place a batch's outputs are checked."""
        self.spec.check_outputs(outputs, rows)
        if self.require_finite:
            for key, value in outputs.items():
                if value.dtype.kind in "fc" and not np.isfinite(value).all():
                    raise RunnerError(f"{self.name}: output {key!r} holds NaN or Inf")

    # ---------------------------------------------------------------- close

    async def _close_on_loop(self, drain: bool) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSING
        scheduler = self._scheduler
        if not drain:
            for r in scheduler.queue.take_all():
                self.stats.request_failure += 1
                r.fail(ModelNotReady(f"{self.name}: batcher closed before the request ran"))
        scheduler.flush = True
        scheduler.drained = asyncio.Event()
        scheduler.poke()
        await scheduler.drained.wait()
        scheduler.cancel_timer()
        self._state = _State.CLOSED

    def _finish_close(self) -> None:
        self._state = _State.CLOSED
        self._instances.stop()
        self._bridge.close()
