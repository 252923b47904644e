"""Where batches execute: ``instance_count`` worker threads (Triton's instance group), or
the event loop itself.

Threads suit engines that release the GIL while they compute (ONNX Runtime, TensorRT,
PyTorch) and avoid pickling every tensor as a process pool would; each batch costs one
thread hop out and one back. The loop suits batch functions that take microseconds or
are coroutines, as Ray's ``@serve.batch`` runs them. Either way a batch runs through the
one path in ``execute`` and its outcome goes to ``complete`` on the loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import tracing
from ..errors import ModelNotReady, ServekitError
from .execute import BatchFn, Steps, detached, drive, drive_async
from .request import Request

__all__ = ["Instances", "Outcome"]

Arrays = dict[str, np.ndarray]
Outcome = tuple[list[Arrays | ServekitError] | None, ServekitError | None, float]
"""Per-request results (or None and the error that failed the whole batch), compute µs."""


class Instances:
    """Runs batches for one model.

    Args:
        fn: the batch function (a coroutine function runs on the loop, awaited).
        steps: a batch's execution steps (``execute.batch_steps`` for its requests).
        complete: called on the loop with (seq, batch, queue_us, outcome).
        call_soon: runs a callable on the loop from a worker thread; False if it is gone.
        executor: ``"threads"`` or ``"loop"``.
    """

    def __init__(
        self,
        fn: BatchFn,
        *,
        count: int,
        name: str,
        executor: str,
        steps: Callable[[list[Request]], Steps],
        complete: Callable[[int, list[Request], tuple[float, ...], Outcome], None],
        call_soon: Callable[..., bool],
    ) -> None:
        self._fn, self.count, self.name, self.executor = fn, count, name, executor
        self._is_async = asyncio.iscoroutinefunction(fn)
        self._steps, self._complete, self._call_soon = steps, complete, call_soon
        self._work: queue.SimpleQueue[tuple[int, list[Request], tuple[float, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def launch(
        self,
        loop: asyncio.AbstractEventLoop,
        seq: int,
        batch: list[Request],
        queue_us: tuple[float, ...],
    ) -> None:
        """Start ``batch`` (called on the loop, with an instance free for it)."""
        if self.executor == "loop":
            if self._is_async:
                task = detached(loop, self._run_async(seq, batch, queue_us))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            else:
                # Deferred so complete never runs inside the decision that launched it.
                loop.call_soon(self._complete, seq, batch, queue_us, self._run(batch))
            return
        if not self._threads:
            for i in range(self.count):
                thread = threading.Thread(
                    target=self._instance_loop,
                    args=(i,),
                    name=f"servekit-{self.name}-{i}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
        self._work.put((seq, batch, queue_us))

    def stop(self) -> None:
        """Let every worker thread finish its batch, then end them."""
        for _ in self._threads:
            self._work.put(None)
        for thread in self._threads:
            thread.join()
        self._threads.clear()

    def _instance_loop(self, index: int) -> None:
        """One model instance: run batches from the work queue until told to stop."""
        while (item := self._work.get()) is not None:
            seq, batch, queue_us = item
            outcome = self._run(batch, index)
            if not self._call_soon(self._complete, seq, batch, queue_us, outcome):
                for r in batch:  # the loop closed under us: fail the callers directly
                    r.fail(ModelNotReady(f"{self.name}: event loop closed"))

    def _run(self, batch: list[Request], instance: int = 0) -> Outcome:
        token = _started(batch, instance)
        start = time.perf_counter()
        try:
            parts: Any = drive(self._steps(batch), self._fn)
        except ServekitError as exc:
            return None, exc, (time.perf_counter() - start) * 1e6
        finally:
            if token is not None:
                tracing.BATCH.reset(token)
        return parts, None, (time.perf_counter() - start) * 1e6

    async def _run_async(self, seq: int, batch: list[Request], queue_us: tuple[float, ...]) -> None:
        token = _started(batch, 0)
        start = time.perf_counter()
        outcome: Outcome
        try:
            parts: Any = await drive_async(self._steps(batch), self._fn)  # type: ignore[arg-type]
            outcome = parts, None, (time.perf_counter() - start) * 1e6
        except ServekitError as exc:
            outcome = None, exc, (time.perf_counter() - start) * 1e6
        except asyncio.CancelledError:  # the loop closing: its callers are failed, not left
            closing = ModelNotReady(f"{self.name}: batch not run (event loop closing)")
            self._complete(seq, batch, queue_us, (None, closing, 0.0))
            raise
        finally:
            if token is not None:
                tracing.BATCH.reset(token)
        self._complete(seq, batch, queue_us, outcome)


def _started(batch: list[Request], instance: int) -> Any:
    """Stamp each request with when and where its batch began to run (its trace's spans);
    where any is traced, the batch's ``tracing.BATCH`` is set (the token resets it)."""
    now, rows = time.monotonic(), sum(r.rows for r in batch)
    parents: list[str] = []
    for r in batch:
        r.started, r.batch_rows, r.instance = now, rows, instance
        if r.parent is not None:
            parents.append(r.parent)
    if not parents:
        return None
    trace = tracing.BatchTrace(parents)
    for r in batch:
        if r.parent is not None:
            r.steps = trace.steps
    return tracing.BATCH.set(trace)
