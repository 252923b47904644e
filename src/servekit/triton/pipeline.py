"""One Triton instance whose device never waits for the hand-over of the next batch.

Triton calls a Python-backend instance's ``execute`` with one batch at a time, and until
it returns the instance takes no other; with the model run inside ``execute`` the device
idles while tritonserver forms the next batch and hands it to the stub (92.7 % of a
simulated T4 with one instance, BENCHMARKS.md "Where the device idles"). Here
``execute`` only reads its batch's inputs and queues it; a thread runs the model batch
after batch, and another sends each request's response through its response sender
(Triton's default, non-decoupled mode: exactly one response, flagged final).

When ``execute`` returns decides what Triton hands over next, and when:

- ``ahead`` (the default, ``[models] overlap``): ``execute`` returns once its batch is
  on the device and about to finish, ``lead`` seconds before its expected end. ``lead``
  is the hand-over as measured (from one ``execute`` returning to the next batch being
  queued), and the batch's run time is learned per size; so Triton forms the next batch
  from all that queued while this one ran, and hands it over while the device finishes.
  One batch runs and at most one waits behind it.
- ``depth`` > 1 without ``ahead``: ``execute`` returns as soon as its batch is queued,
  with at most ``depth`` held; Triton, seeing the instance free at once, forms batches
  of the few requests queued by then (measured: smaller batches, more CPU per request).
- neither: answered inside ``execute`` (``Pipeline`` is not used).

Either way the queue stays Triton's (its delays, priorities and timeouts), memory stays
bounded, Triton's instance count is what the user set, and batches run and are answered
in the order Triton gave them.
"""

from __future__ import annotations

import logging
import os
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..runners.simulated import HANDED

__all__ = ["DEFAULT_DEPTH", "Pipeline", "send_each"]

log = logging.getLogger(__name__)

DEFAULT_DEPTH = int(os.environ.get("SERVEKIT_PIPELINE_DEPTH", "1"))
"""Batches one instance holds at once without ``ahead``: the environment's
``SERVEKIT_PIPELINE_DEPTH``, or the ``pipeline`` parameter of a model's config.pbtxt
(measured and left off: BENCHMARKS.md, "Pipelining one Triton instance")."""


MARGIN_S = 4e-3
"""How early the next batch should be queued before a run ends, under load."""


class _Held:
    """A batch handed to the pipeline: its inputs and senders, and when it may let
    ``submit`` return (``release_at``, known once it is on the device; ``done``)."""

    __slots__ = ("done", "inputs", "queued", "release_at", "senders", "size")

    def __init__(self, inputs: list[Any], senders: list[Any], size: int) -> None:
        self.inputs, self.senders, self.size = inputs, senders, size
        self.queued = time.monotonic()
        self.release_at: float | None = None
        self.done = False


class Pipeline:
    """``run(inputs) -> results`` on a thread of its own, ``send(senders, results)`` on
    another; ``submit`` queues a batch and returns as the mode above says. ``run``
    answers the inputs of the batches it is given with one result per sender, in order
    (the servekit backend: one input per request; the PyTriton shim: one per batch).
    ``size(inputs)`` is what a batch's run time depends on (rows; default its length);
    ``overlapped()`` is called for each batch queued while the one before it ran."""

    def __init__(
        self,
        run: Callable[[list[Any]], Sequence[Any]],
        send: Callable[[list[Any], Sequence[Any]], None],
        depth: int = DEFAULT_DEPTH,
        *,
        ahead: bool = False,
        size: Callable[[list[Any]], int] = len,
        overlapped: Callable[[], object] = lambda: None,
    ) -> None:
        self._run, self._send, self._size, self.ahead = run, send, size, ahead
        self._overlapped = overlapped
        self.overlapped = 0
        """Batches queued while the one before them ran (each also ``overlapped()``)."""
        # ahead: one running, one being answered, one handed over behind them.
        self._slots = threading.Semaphore(3 if ahead else depth)
        self._held = threading.Condition()
        self._took: dict[int, float] = {}
        """Seconds a run of each size took (a moving average)."""
        self._handovers: deque[float] = deque(maxlen=16)
        self._released: float | None = None
        self._late = 0.0
        """Added to the lead: how late next batches came after runs ended (see ``_learn``)."""
        self._ran: tuple[float, float] | None = None
        self._ended: tuple[float, float] | None = None
        """The last run's end and expected time, until the next batch is taken."""
        self._batches: queue.Queue[_Held | None] = queue.Queue()
        self._answers: queue.Queue[tuple[list[Any], Sequence[Any]] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._running, name="servekit-run", daemon=True),
            threading.Thread(target=self._sending, name="servekit-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, inputs: list[Any], senders: list[Any]) -> None:
        if self.ahead and self._released is not None:
            self._handovers.append(time.monotonic() - self._released)
        self._slots.acquire()
        held = _Held(inputs, senders, self._size(inputs) if self.ahead else 0)
        self._batches.put(held)
        if not self.ahead:
            return
        with self._held:
            while not held.done:
                if held.release_at is None:
                    self._held.wait()
                    continue
                left = held.release_at - time.monotonic()
                if left <= 0:
                    break
                self._held.wait(left)
        self._released = time.monotonic()

    def ran(self, start: float, end: float) -> None:
        """Called by ``run`` where the batch ran elsewhere (``time.monotonic`` times): when
        it really started and ended there, for the times this process cannot see."""
        self._ran = (start, end)

    @property
    def lead_s(self) -> float:
        """How long before a run's expected end ``submit`` returns: the hand-over's
        median with half again as margin, plus a millisecond, plus what ``_learn`` found
        missing."""
        if not self._handovers:
            return self._late
        return 1.5 * statistics.median(self._handovers) + 1e-3 + self._late

    def _learn(self, batch: _Held) -> None:
        """Lengthen the lead by half of how late ``batch`` came after the last run ended
        (shorten it by half of how early, beyond ``MARGIN_S``): the hand-over measured in
        this process misses what happens outside it (on PyTriton, the answers' way back
        and the next batch's way to the infer function)."""
        if self._ended is None:
            return
        (ended, expected), self._ended = self._ended, None
        late = batch.queued - (ended - MARGIN_S)
        if late < expected:  # later than that, the queue was empty: no load, nothing to learn
            self._late = min(max(self._late + late / 2, 0.0), expected / 2)

    def expected_s(self, size: int) -> float | None:
        """A run's expected time at ``size``: learned at that size, else at the nearest
        larger one (an upper bound), else None (its ``submit`` waits for the end)."""
        took = self._took.get(size)
        if took is None:
            larger = [s for s in self._took if s > size]
            took = self._took[min(larger)] if larger else None
        return took

    def _running(self) -> None:
        while (batch := self._batches.get()) is not None:
            # Every batch handed over while the last one ran goes in this run: Triton
            # formed the later ones from what had queued by then, often a request or two,
            # and ``run`` groups rows up to the model's max batch size again.
            batches, closing = [batch], False
            while not closing:
                try:
                    more = self._batches.get_nowait()
                except queue.Empty:
                    break
                closing = more is None
                if more is not None:
                    batches.append(more)
            inputs = [x for b in batches for x in b.inputs]
            start = time.monotonic()
            if self._ended is not None:  # it started when both it and the device were ready
                start = min(start, max(batch.queued, self._ended[0]))
            size = sum(b.size for b in batches)
            # Queued before the last run ended: this run's time is the device's alone, not
            # also the way to it from idle (which on PyTriton is another process's).
            back_to_back = self._ended is not None and batch.queued < self._ended[0]
            if back_to_back:
                self.overlapped += 1
                try:
                    self._overlapped()
                except Exception:  # a counter, never worth a stopped device
                    log.exception("servekit pipeline: counting an overlapped batch failed")
            if self.ahead:
                self._learn(batch)
                expected = self.expected_s(size)
                if expected is not None:
                    with self._held:
                        for b in batches:
                            b.release_at = start + expected - self.lead_s
                        self._held.notify_all()
            self._ran = None
            handed = HANDED.set(time.time() - (time.monotonic() - batch.queued))
            try:
                results: Sequence[Any] = self._run(inputs)
            except BaseException as exc:  # run answers per request; anything else fails the run
                results = [exc] * sum(len(b.senders) for b in batches)
            finally:
                HANDED.reset(handed)
            if self.ahead:
                ended = time.monotonic()
                if self._ran is not None:
                    start, ended = self._ran
                before = self._took.get(size)
                if before is None or back_to_back:
                    took = ended - start
                    self._took[size] = took if before is None else 0.8 * before + 0.2 * took
                self._ended = (ended, self._took[size])
                with self._held:
                    for b in batches:
                        b.done = True
                    self._held.notify_all()
            first = 0
            for b in batches:
                self._answers.put((b.senders, results[first : first + len(b.senders)]))
                first += len(b.senders)
            if closing:
                break
        self._answers.put(None)

    def _sending(self) -> None:
        while (answer := self._answers.get()) is not None:
            try:
                self._send(*answer)
            except Exception:  # a sender gone (its request cancelled): the next batches go on
                log.exception("servekit pipeline: answering a batch failed")
            finally:
                self._slots.release()

    def close(self) -> None:
        """Answer what is queued, then stop both threads."""
        self._batches.put(None)
        for thread in self._threads:
            thread.join()


def send_each(senders: Sequence[Any], responses: Sequence[Any], send: Callable[..., None]) -> None:
    """``send(sender, response)`` for every request of a batch, each on its own: one whose
    sender fails (its request cancelled, its client gone) is logged, and the others are
    still answered."""
    for sender, response in zip(senders, responses, strict=True):
        try:
            send(sender, response)
        except Exception:
            log.exception("servekit pipeline: a response could not be sent")
