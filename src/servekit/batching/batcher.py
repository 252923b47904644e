"""The Batcher: Triton-style dynamic batching in front of any Runner, for asyncio and threads.

Scheduling runs on one asyncio event loop: the caller's loop on the first
``await infer`` (no thread hop per request), or a private loop thread when only
``infer_sync`` is used. Batches execute on ``instance_count`` worker threads: engines
(ONNX Runtime, TensorRT, PyTorch) release the GIL while they compute, and threads
avoid pickling every tensor as a process pool would. Each batch costs one
thread hop out and one back; requests pay only validation, a deque append and
their future.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from enum import Enum
from typing import Any

import numpy as np

from ..errors import (
    DeadlineExceeded,
    InvalidInput,
    ModelNotReady,
    Overloaded,
    RunnerError,
    ServekitError,
)
from ..runners.base import BaseRunner
from ..spec import ModelSpec
from .concat import concat, split
from .decision import decide
from .execute import run_requests
from .policy import BatchingPolicy
from .queue import RequestQueue
from .request import Request
from .stats import BatcherStats, BatchRecord

__all__ = ["Batcher"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
BatchFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


class _AsRunner:
    """A batch function seen as a Runner, for ``run_requests``."""

    def __init__(self, fn: BatchFn, spec: ModelSpec) -> None:
        self.infer, self.spec = fn, spec


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
        clock: monotonic seconds; injectable for tests.
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
    ) -> None:
        self.require_finite = require_finite
        if hasattr(runner, "infer") and hasattr(runner, "spec"):
            self._fn: BatchFn = runner.infer
            spec = spec or runner.spec
            # BaseRunner checks its own outputs; anything else is checked here.
            self._check_outputs = not (isinstance(runner, BaseRunner) and runner.check_outputs)
        elif callable(runner):
            if spec is None:
                raise TypeError("Batcher(fn) needs spec= when fn is a plain function")
            self._fn = runner
            self._check_outputs = True
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
        is_async = asyncio.iscoroutinefunction(self._fn)
        if executor is None:
            executor = "loop" if is_async else "threads"
        if executor not in ("threads", "loop"):
            raise ValueError(f"executor must be 'threads' or 'loop', got {executor!r}")
        if is_async and executor == "threads":
            raise ValueError(f"{name}: a coroutine batch function must run with executor='loop'")
        self.executor = executor
        self._is_async = is_async
        self._tasks: set[asyncio.Task] = set()
        if instance_count < 1:
            raise ValueError(f"instance_count must be >= 1, got {instance_count}")
        self.spec, self.policy, self.name = spec, policy, name
        self.instance_count = instance_count
        self.stats = BatcherStats()
        self.listeners = list(listeners)
        self._clock = clock
        self._names = [t.name for t in spec.inputs]
        self._limit = policy.batch_limit(spec.max_batch_size)
        self._preferred = frozenset(policy.preferred_batch_sizes)
        self._delay_s = policy.max_queue_delay_us / 1e6
        self._queue = RequestQueue(policy)
        self._max_rows = policy.max_batch_size
        self._default_level = policy.level_of(0)
        self._default_timeout_us = policy.queue_policy(self._default_level).timeout_us(None)
        self._work: queue.SimpleQueue[tuple[int, list[Request], tuple[float, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._instances: list[threading.Thread] = []
        self._free = instance_count
        self._ids = itertools.count()
        self._state = _State.OPEN
        self._accepting = True  # guarded by _lock: threads may still hand requests to the loop
        self._inbox: collections.deque[Request] = collections.deque()  # guarded by _lock
        self._inbox_signalled = False
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread_id: int | None = None
        self._private_thread: threading.Thread | None = None
        self._poke_pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = math.inf
        self._drained: asyncio.Event | None = None
        self._next_seq = 0
        self._deliver_seq = 0
        self._held: dict[int, tuple[list[Request], list[Arrays] | None, BaseException | None]] = {}

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
        if self._loop is not loop and not self._bind(loop):
            fut = self._submit_threadsafe(inputs, priority, timeout_us)
            return await asyncio.wrap_future(fut)
        if self._state is not _State.OPEN:
            raise ModelNotReady(f"{self.name}: batcher is {self._state.value}")
        request = self._request(inputs, priority, timeout_us, loop.create_future())
        self._enqueue(request)
        try:
            return await request.future  # type: ignore[no-any-return,misc]
        except asyncio.CancelledError:
            self.stats.request_cancelled += 1
            raise

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
        if self._on_own_loop():
            raise RuntimeError(
                "infer_sync would block the batcher's own event loop; use `await batcher.infer()`"
            )
        fut = self._submit_threadsafe(inputs, priority, timeout_us)
        try:
            return fut.result(wait_s)  # type: ignore[no-any-return]
        except concurrent.futures.TimeoutError:
            if fut.cancel():
                self._call_on_loop(self._count_cancelled)
            raise DeadlineExceeded(f"{self.name}: no result within {wait_s} s") from None

    async def aclose(self, drain: bool = True) -> None:
        """Stop accepting; run (``drain``) or fail every queued request; wait for running batches."""
        with self._lock:
            self._accepting = False
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            if asyncio.get_running_loop() is loop:
                await self._close_on_loop(drain)
            else:
                cf = asyncio.run_coroutine_threadsafe(self._close_on_loop(drain), loop)
                await asyncio.wrap_future(cf)
        self._finish_close()

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Blocking ``aclose`` for threaded callers (not from the batcher's own loop)."""
        if self._on_own_loop():
            raise RuntimeError(
                "close() would block the batcher's event loop; use `await batcher.aclose()`"
            )
        with self._lock:
            self._accepting = False
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
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
    def pending(self) -> int:
        """Requests waiting in the queue (Triton's ``nv_inference_pending_request_count``)."""
        return len(self._queue)

    # ------------------------------------------------------------ admission

    def _request(
        self,
        inputs: Mapping[str, np.ndarray],
        priority: int,
        timeout_us: int | None,
        future: asyncio.Future | concurrent.futures.Future,
    ) -> Request:
        level, timeout = self._default_level, self._default_timeout_us
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
                self.stats.request_invalid += 1
            raise
        now = self._clock()
        names = self._names
        shape_key = (
            (inputs[names[0]].shape[1:],)
            if len(names) == 1
            else tuple(inputs[n].shape[1:] for n in names)
        )
        deadline = now + timeout / 1e6 if timeout else math.inf
        return Request(next(self._ids), inputs, rows, shape_key, level, now, deadline, future)

    def _enqueue(self, request: Request) -> None:
        if self._free and not self._delay_s and self._queue.idle():
            # What decide() would do for a lone request with no delay, minus the queue round trip.
            request.taken = True
            self._launch([request], request.arrival)
            return
        try:
            self._queue.push(request)
        except Overloaded:
            self.stats.request_rejected += 1
            self.stats.request_failure += 1
            raise
        if self._free and not self._delay_s:
            self._poke()  # an idle instance and nothing to wait for: start now
        elif not self._poke_pending:
            # Coalesce: one decision per loop iteration however many requests arrive in it.
            self._poke_pending = True
            self._loop.call_soon(self._poke)  # type: ignore[union-attr]

    def _enqueue_from_thread(self, request: Request) -> None:
        if self._state is not _State.OPEN:
            request.fail(ModelNotReady(f"{self.name}: batcher is {self._state.value}"))
            return
        try:
            self._enqueue(request)
        except Overloaded as exc:
            request.fail(exc)

    def _submit_threadsafe(
        self, inputs: Mapping[str, np.ndarray], priority: int, timeout_us: int | None
    ) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        request = self._request(inputs, priority, timeout_us, fut)
        with self._lock:
            if not self._accepting:
                raise ModelNotReady(f"{self.name}: batcher is closed")
            loop = self._ensure_loop()
            self._inbox.append(request)
            # One wake-up of the loop per burst of thread callers, not one per request.
            if not self._inbox_signalled:
                self._inbox_signalled = True
                loop.call_soon_threadsafe(self._drain_inbox)
        return fut

    def _drain_inbox(self) -> None:
        with self._lock:
            requests = list(self._inbox)
            self._inbox.clear()
            self._inbox_signalled = False
        for request in requests:
            self._enqueue_from_thread(request)

    def _on_own_loop(self) -> bool:
        """Whether the caller is on the batcher's running loop (blocking there would deadlock)."""
        loop = self._loop
        return (
            loop is not None
            and loop.is_running()
            and not loop.is_closed()
            and self._loop_thread_id == threading.get_ident()
        )

    def _count_cancelled(self) -> None:
        self.stats.request_cancelled += 1

    def _call_on_loop(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn)

    # ---------------------------------------------------------------- loops

    def _bind(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Make ``loop`` (the running one) the scheduling loop if none is usable; False if another is."""
        with self._lock:
            current = self._loop
            if current is loop:
                return True
            if current is not None and not current.is_closed():
                return False
            self._loop = loop
            self._loop_thread_id = threading.get_ident()
            return True

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The scheduling loop for thread callers; starts a private one if none runs (holds _lock)."""
        if self._loop is not None and not self._loop.is_closed():
            return self._loop
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._loop_thread_id = threading.get_ident()
            loop.call_soon(ready.set)
            loop.run_forever()

        thread = threading.Thread(target=run, name=f"servekit-{self.name}-loop", daemon=True)
        self._loop, self._private_thread = loop, thread
        thread.start()
        ready.wait()
        return loop

    # ------------------------------------------------------------ scheduling

    def _poke(self) -> None:
        """Expire timeouts, then start batches while instances are free; arm the next wake-up."""
        self._poke_pending = False
        if self._drained is None and self._queue.idle():
            return
        now = self._clock()
        timed_out = self._queue.expire(now)
        if timed_out:
            self.stats.request_timeout += timed_out
            self.stats.request_failure += timed_out
        wait: float | None = None
        flush = self._state is not _State.OPEN
        while self._free:
            pending = self._queue.peek(self._limit + 1)
            if not pending:
                break
            d = decide(
                pending,
                now,
                limit=self._limit,
                preferred=self._preferred,
                delay_s=self._delay_s,
                flush=flush,
            )
            if not d.take:
                wait = d.wait_s
                break
            batch = pending[: d.take]
            self._queue.take(batch)
            self._launch(batch, now)
        deadline = self._queue.next_deadline()
        if deadline is not None:
            wait = min(wait if wait is not None else math.inf, max(deadline - now, 0.0))
        if wait is not None:
            self._arm(wait)
        if (
            self._drained is not None
            and self._free == self.instance_count
            and not self._queue.peek(1)
        ):
            self._drained.set()

    def _arm(self, wait_s: float) -> None:
        loop = self._loop
        assert loop is not None
        when = loop.time() + wait_s
        if self._timer is not None:
            if self._timer_when <= when:
                return
            self._timer.cancel()
        self._timer, self._timer_when = loop.call_at(when, self._on_timer), when

    def _on_timer(self) -> None:
        self._timer, self._timer_when = None, math.inf
        self._poke()

    def _launch(self, batch: list[Request], now: float) -> None:
        self._free -= 1
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        queue_us = tuple((now - r.arrival) * 1e6 for r in batch)
        loop = self._loop
        assert loop is not None
        if self.executor == "loop":
            if self._is_async:
                task = loop.create_task(self._run_batch_async(seq, batch, queue_us))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                # Deferred so _complete never runs inside the _poke that launched it.
                loop.call_soon(self._complete, seq, batch, queue_us, *self._run_batch(batch))
            return
        if not self._instances:
            for _ in range(self.instance_count):
                self._start_instance()
        self._work.put((seq, batch, queue_us))

    def _start_instance(self) -> None:
        thread = threading.Thread(
            target=self._instance_loop,
            name=f"servekit-{self.name}-{len(self._instances)}",
            daemon=True,
        )
        self._instances.append(thread)
        thread.start()

    def _instance_loop(self) -> None:
        """One model instance: run batches from the work queue until told to stop."""
        while (item := self._work.get()) is not None:
            seq, batch, queue_us = item
            result = self._run_batch(batch)
            loop = self._loop
            try:
                loop.call_soon_threadsafe(self._complete, seq, batch, queue_us, *result)  # type: ignore[union-attr]
            except RuntimeError:  # the loop closed under us: fail the callers directly
                for r in batch:
                    r.fail(ModelNotReady(f"{self.name}: event loop closed"))

    def _run_batch(
        self, batch: list[Request]
    ) -> tuple[list[Arrays] | None, BaseException | None, float]:
        """Concat, run, check, split; returns (parts, error, compute_us) and never raises."""
        start = time.perf_counter()
        rows = [r.rows for r in batch]
        try:
            outputs = self._fn(concat([r.inputs for r in batch], self._names))
            return self._split(outputs, rows), None, (time.perf_counter() - start) * 1e6
        except InvalidInput as exc:
            if len(batch) == 1:
                return None, exc, (time.perf_counter() - start) * 1e6
            # Bad input found only while running (an undecodable image, say): run the
            # requests one by one so only the culprit fails.
            parts = run_requests(_AsRunner(self._fn, self.spec), [r.inputs for r in batch])
            return parts, None, (time.perf_counter() - start) * 1e6  # type: ignore[return-value]
        except Exception as exc:
            return None, self._as_error(exc), (time.perf_counter() - start) * 1e6

    async def _run_batch_async(
        self, seq: int, batch: list[Request], queue_us: tuple[float, ...]
    ) -> None:
        start = time.perf_counter()
        rows = [r.rows for r in batch]
        parts: list[Arrays] | None = None
        error: BaseException | None = None
        try:
            outputs = await self._fn(concat([r.inputs for r in batch], self._names))  # type: ignore[misc]
            parts = self._split(outputs, rows)
        except InvalidInput as exc:
            if len(batch) == 1:
                error = exc
            else:  # as in _run_batch: one by one, so only the culprit fails
                parts = [await self._run_one_async(r) for r in batch]  # type: ignore[misc]
        except Exception as exc:
            error = self._as_error(exc)
        self._complete(seq, batch, queue_us, parts, error, (time.perf_counter() - start) * 1e6)

    async def _run_one_async(self, request: Request) -> Arrays | ServekitError:
        try:
            outputs = await self._fn(concat([request.inputs], self._names))  # type: ignore[misc]
            return self._split(outputs, [request.rows])[0]
        except Exception as exc:
            return self._as_error(exc)

    def _split(self, outputs: Mapping[str, np.ndarray], rows: list[int]) -> list[Arrays]:
        if self._check_outputs:
            self.spec.check_outputs(outputs, sum(rows))
        if self.require_finite:
            for key, value in outputs.items():
                if value.dtype.kind in "fc" and not np.isfinite(value).all():
                    raise RunnerError(f"{self.name}: output {key!r} holds NaN or Inf")
        return split(outputs, rows)

    def _as_error(self, exc: Exception) -> ServekitError:
        if isinstance(exc, ServekitError):
            return exc
        error = RunnerError(f"{self.name}: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    def _complete(
        self,
        seq: int,
        batch: list[Request],
        queue_us: tuple[float, ...],
        parts: list[Arrays] | None,
        error: BaseException | None,
        compute_us: float,
    ) -> None:
        self._free += 1
        rows = sum(r.rows for r in batch)
        s = self.stats
        s.execution_count += 1
        s.inference_count += rows
        s.batch_rows[rows] += 1
        s.queue_us += sum(queue_us)
        s.compute_us += compute_us
        if self.policy.preserve_ordering:
            self._held[seq] = (batch, parts, error)
            while self._deliver_seq in self._held:
                self._deliver(*self._held.pop(self._deliver_seq))
                self._deliver_seq += 1
        else:
            self._deliver(batch, parts, error)
        if self.listeners:
            record = BatchRecord(len(batch), rows, queue_us, compute_us, error)
            for listener in self.listeners:
                try:
                    listener(record)
                except Exception:
                    log.exception("batch listener %r failed", listener)
        self._poke()

    def _deliver(
        self, batch: list[Request], parts: list[Arrays] | None, error: BaseException | None
    ) -> None:
        if parts is None:
            self.stats.request_failure += len(batch)
            for r in batch:
                r.fail(error or RunnerError(f"{self.name}: batch failed"))
            return
        for r, out in zip(batch, parts, strict=True):
            if isinstance(out, BaseException):
                self.stats.request_failure += 1
                r.fail(out)
                continue
            self.stats.request_success += 1
            fut = r.future
            if not fut.done():
                try:  # noqa: SIM105 (contextlib.suppress costs more in this loop)
                    fut.set_result(out)
                except concurrent.futures.InvalidStateError:
                    pass  # a thread caller cancelled between the check and the set

    # ---------------------------------------------------------------- close

    async def _close_on_loop(self, drain: bool) -> None:
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSING
        if not drain:
            for r in self._queue.take_all():
                self.stats.request_failure += 1
                r.fail(ModelNotReady(f"{self.name}: batcher closed before the request ran"))
        self._drained = asyncio.Event()
        self._poke()
        await self._drained.wait()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._state = _State.CLOSED

    def _finish_close(self) -> None:
        self._state = _State.CLOSED
        for _ in self._instances:
            self._work.put(None)
        for instance in self._instances:
            instance.join()
        self._instances.clear()
        thread = self._private_thread
        if thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join()
            self._loop.close()
            self._private_thread = None
