"""The servekit backend's pipeline: one Triton instance whose device never waits for the
hand-over of the next batch.

Triton calls a Python-backend instance's ``execute`` with one batch at a time, and until
it returns the instance takes no other; with the model run inside ``execute`` the device
idles while tritonserver hands each batch to the stub and its answers back (88 % of a
simulated T4 with one instance, BENCHMARKS.md). Here ``execute`` only reads its batch's
inputs and queues it; a thread runs the model batch after batch, and another sends each
request's response through its response sender (Triton's default, non-decoupled mode:
exactly one response, flagged final). The batches handed over while one ran are run
together next (``run`` groups their rows up to the model's max batch size again), since
Triton forms each of them from the few requests queued by the time the last one was
handed over. At most ``depth`` batches are queued or running:
``execute`` waits beyond that, so the queue stays Triton's (its delays, priorities and
timeouts), memory stays bounded and Triton's instance count is what the user set.
Batches run and are answered in the order Triton gave them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DEFAULT_DEPTH", "Pipeline", "send_each"]

log = logging.getLogger(__name__)

DEFAULT_DEPTH = int(os.environ.get("SERVEKIT_PIPELINE_DEPTH", "1"))
"""Batches one instance holds at once: the environment's ``SERVEKIT_PIPELINE_DEPTH``, or
the ``pipeline`` parameter of a model's config.pbtxt. 1 (the default) answers inside
``execute``: on the simulated T4 the pipeline did not pay for itself (BENCHMARKS.md,
"Pipelining one Triton instance"), so it is there to try, not on."""

Batch = tuple[list[Any], list[Any]]
"""A batch's inputs (one dict of arrays per request) and its requests' response senders."""


class Pipeline:
    """``run(inputs) -> results`` on a thread of its own, ``send(senders, results)`` on
    another; ``submit`` queues a batch, waiting while ``depth`` are in flight. ``run``
    answers the inputs of the batches it is given with one result per sender, in order
    (the servekit backend: one input per request; the PyTriton shim: one per batch)."""

    def __init__(
        self,
        run: Callable[[list[Any]], Sequence[Any]],
        send: Callable[[list[Any], Sequence[Any]], None],
        depth: int = DEFAULT_DEPTH,
    ) -> None:
        self._run, self._send = run, send
        self._slots = threading.Semaphore(depth)
        self._batches: queue.Queue[Batch | None] = queue.Queue()
        self._answers: queue.Queue[tuple[list[Any], Sequence[Any]] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._running, name="servekit-run", daemon=True),
            threading.Thread(target=self._sending, name="servekit-send", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, inputs: list[Any], senders: list[Any]) -> None:
        self._slots.acquire()
        self._batches.put((inputs, senders))

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
            inputs = [x for b in batches for x in b[0]]
            try:
                results: Sequence[Any] = self._run(inputs)
            except BaseException as exc:  # run answers per request; anything else fails the run
                results = [exc] * sum(len(senders) for _, senders in batches)
            start = 0
            for _, senders in batches:
                self._answers.put((senders, results[start : start + len(senders)]))
                start += len(senders)
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
