"""The one execution path of every batch, where one request's fault fails it alone.

A batch that raises (any exception: a bad image found while decoding, a user's
``ValueError`` on one request's values, a device out of memory) is split in halves and
each half run again, down to the requests that raise; every other request gets its own
outputs. When both halves fail with the batch's own error (same type, same words) it is
a broken model or several requests raising the same words (clients sending the same bad
input): one request the model answered before (``Fit.good``; else one of zeros) is run
alone. If it fails too the model is broken and the whole batch fails at once (four runs,
never log2(n) more); if it is answered, the halves are split on down to the requests
that raise. An ``InvalidInput`` is always the requests' own: no such run. A sticky CUDA
error (``cuda.is_sticky``: an illegal address, a device-side assert) is never split:
every later call in the process fails, so the batch's unanswered requests get
``DeviceLost`` at once, and so does every later batch (``Fit.lost``) without a call.
``run_requests`` does the same for requests a server already grouped (Triton, PyTriton,
Ray), after validating each.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..cuda import is_sticky, lose
from ..errors import DeviceLost, InvalidInput, RunnerError, ServekitError
from ..runners.base import batch_function, staging_of
from ..runners.staging import Lends, Staging
from ..spec import ModelSpec
from .concat import concat, split
from .faults import FAULTS, cause, is_out_of_memory, same_fault

PROBE_AFTER = 32
"""Batches run in parts without an out-of-memory error before the fitted rows double."""

__all__ = [
    "PROBE_AFTER", "BatchFn", "CallCancelled", "Fit", "Steps", "as_error", "awaited",
    "batch_steps", "detached", "device_lost", "drive", "drive_async", "run_requests",
]  # fmt: skip

_T = TypeVar("_T")

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
BatchFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
Steps = Generator[Arrays, Mapping[str, np.ndarray], list[Arrays | ServekitError]]
"""One batch's execution: yields the inputs to run, is sent their outputs (or has the
model's exception thrown in), returns one result per request."""


def as_error(exc: BaseException, name: str = "") -> ServekitError:
    """``exc`` as the error a caller gets: a ServekitError as it is, anything else a
    ``RunnerError`` naming the model and the exception."""
    if isinstance(exc, ServekitError):
        return exc
    error = RunnerError(f"{name + ': ' if name else ''}{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


class CallCancelled(RuntimeError):
    """A call a batch function awaited was cancelled by its owner, not by the batcher."""


async def awaited(call: Awaitable[_T]) -> _T:
    """``await call``; a cancellation that is not this task's own (the call's owner
    cancelled it under the batch) raises ``CallCancelled``, which fails the batch as any
    error of its function would, instead of ending the task with its callers unanswered."""
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        raise CallCancelled("a call the batch awaited was cancelled under it") from None


def detached(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None]:
    """``coro`` (a batch) as a task in a context of its own. A batch belongs to no one
    request, so nothing of the request whose arrival launched it reaches it: above all
    Ray's task id, under which Ray cancels every call made once that request is cancelled
    (a client that left would take the batch of those who stayed with it)."""
    return loop.create_task(coro, context=contextvars.Context())


@dataclass
class Fit:
    """What a model's runs taught, kept for its next batches."""

    rows: int = 0
    """After an out-of-memory error, the most rows a batch that then ran held (0: no limit
    learned). Larger batches run in parts of at most that; after ``PROBE_AFTER`` batches
    in a row that ran so without running out, the limit doubles (memory another model or
    a transient peak held may be free again)."""
    streak: int = 0
    """Batches in a row run in parts without running out of memory."""
    good: Arrays | None = None
    """A copy of one request the model answered (the fewest rows seen), run alone before a
    batch whose halves fail with its own words is judged a broken model."""
    good_rows: int = 0
    lost: str | None = None
    """``device lost: <CUDA's words>`` once a run raised a sticky CUDA error: the device
    of this process serves no more, and nothing is run on it again."""


def batch_steps(
    requests: Sequence[Mapping[str, np.ndarray]],
    rows: Sequence[int],
    names: Sequence[str],
    check: Callable[[Mapping[str, np.ndarray], int], None],
    name: str = "",
    staging: Lends | None = None,
    fit: Fit | None = None,
) -> Steps:
    """Run ``requests`` as one batch, ``check`` its outputs and split them; a failing
    batch is split until only the requests that raise fail (the module's docstring).

    With ``staging`` (the runner's, ``runners.staging``) each run is gathered into a
    borrowed staging's reused buffers instead of new arrays, returned after its outputs no
    longer share them. ``fit`` remembers the rows that fitted the device after an
    out-of-memory error, and a request the model answered.

    Driven by ``drive`` (threads) or ``drive_async`` (coroutine models)."""
    run = _Run(requests, rows, names, check, name, fit or Fit())
    if staging is None:
        return (yield from run.all())
    with staging.lend() as borrowed:
        run.staging = borrowed
        return (yield from run.all())


class _Run:
    """One batch's runs: the whole (in parts where a limit was learned), then halves of
    what failed."""

    def __init__(
        self,
        requests: Sequence[Mapping[str, np.ndarray]],
        rows: Sequence[int],
        names: Sequence[str],
        check: Callable[[Mapping[str, np.ndarray], int], None],
        name: str,
        fit: Fit,
    ) -> None:
        self.requests, self.rows, self.names, self.check = requests, rows, names, check
        self.name, self.fit = name, fit
        self.staging: Staging | None = None
        self.results: list[Arrays | ServekitError | None] = [None] * len(requests)
        self.works: bool | None = None
        """Whether the model answered a request known to be good during this batch (None:
        not tried)."""

    def all(self) -> Steps:
        members = list(range(len(self.requests)))
        parts = _within(members, self.rows, self.fit.rows) if self.fit.rows else [members]
        limit = self.fit.rows
        for part in parts:
            if self.fit.lost:
                break
            exc = yield from self._run(part)
            if exc is not None:
                yield from self._isolate(part, exc)
        if self.fit.lost:  # the device is gone: what it did not answer fails so, unsplit
            lost = DeviceLost(f"{'model ' + self.name + ': ' if self.name else ''}{self.fit.lost}")
            self.results = [lost if r is None else r for r in self.results]
        elif len(parts) > 1 and self.fit.rows == limit:  # parts ran, nothing ran out
            self._probe()
        if len(self.requests) == 1 and isinstance(self.results[0], ServekitError):
            raise self.results[0]  # the batch's error: it was its only request
        return self.results  # type: ignore[return-value]

    def _run(
        self, members: list[int]
    ) -> Generator[Arrays, Mapping[str, np.ndarray], Exception | None]:
        """Run ``members`` together: their outputs placed, or the exception they raised."""
        gather = concat if self.staging is None else self.staging.gather
        try:
            outputs = yield gather([self.requests[i] for i in members], self.names)
            if self.staging is not None:
                outputs = self.staging.detach(outputs)
            rows = [self.rows[i] for i in members]
            self.check(outputs, sum(rows))
            for i, part in zip(members, split(outputs, rows), strict=True):
                self.results[i] = part
        except Exception as exc:
            self._sticky(exc)
            return exc
        self._remember(min(members, key=self.rows.__getitem__))
        return None

    def _sticky(self, exc: Exception) -> None:
        """A sticky CUDA error lost the device: said once, and nothing runs on it again."""
        if self.fit.lost is None and is_sticky(exc):
            self.fit.lost = f"device lost: {cause(exc)}"
            lose(f"{self.name + ': ' if self.name else ''}{self.fit.lost}")
            FAULTS(self.name, exc)
            log.error("%s: %s; the model is not ready from now on", self.name, self.fit.lost)

    def _remember(self, i: int) -> None:
        """Keep request ``i`` as the model's known-good request when it has fewer rows
        than the one kept (a copy: the caller's arrays are the caller's)."""
        if self.fit.good is None or self.rows[i] < self.fit.good_rows:
            request = self.requests[i]
            self.fit.good = {n: np.array(request[n], copy=True) for n in self.names}
            self.fit.good_rows = self.rows[i]

    def _answers(self, members: list[int]) -> Generator[Arrays, Mapping[str, np.ndarray], bool]:
        """Whether the model answers a request alone: the one it answered before, or one of
        zeros shaped like ``members[0]`` when it has answered none. One run per batch."""
        if self.works is None:
            if self.fit.good is not None:
                probe, rows = self.fit.good, self.fit.good_rows
            else:
                probe, rows = _zeros(self.requests[members[0]], self.names), self.rows[members[0]]
            gather = concat if self.staging is None else self.staging.gather
            try:
                outputs = yield gather([probe], self.names)
                self.check(outputs, rows)
                self.works = True
            except Exception as exc:
                self._sticky(exc)
                self.works = False
        return self.works

    def _isolate(
        self, members: list[int], exc: Exception
    ) -> Generator[Arrays, Mapping[str, np.ndarray], None]:
        """``members`` failed together with ``exc``: run their halves to find who raises."""
        if self.fit.lost:  # halving cannot help: every later call fails (``all``)
            return
        if len(members) == 1:
            self._fail(members, exc)
            return
        oom = is_out_of_memory(exc)
        half = len(members) // 2
        left, right = members[:half], members[half:]
        first = yield from self._run(left)
        second = (yield from self._run(right)) if not self.fit.lost else None
        if self.fit.lost:
            return
        if oom:
            self._fitted([m for m, e in ((left, first), (right, second)) if e is None])
        elif _same_fault(exc, first, second) and not (yield from self._answers(members)):
            self._fail(members, exc)  # the model, not a request: no more runs
            return
        if first is not None:
            yield from self._isolate(left, first)
        if second is not None:
            yield from self._isolate(right, second)

    def _fail(self, members: list[int], exc: Exception) -> None:
        error = as_error(exc, self.name)
        if not isinstance(exc, InvalidInput):  # a request's fault is not the model's
            FAULTS(self.name, exc)
        for i in members:
            self.results[i] = error

    def _fitted(self, ran: list[list[int]]) -> None:
        """A run ran out of memory and its halves ``ran``: the largest that ran is the
        limit from now on, lower than before when the fitted size itself ran out."""
        self.fit.streak = 0
        rows = max((sum(self.rows[i] for i in part) for part in ran), default=0)
        if rows and rows != self.fit.rows:
            log.warning(
                "%s: the device ran out of memory on a batch of %d rows; batches of at "
                "most %d rows fitted and are run from now on",
                self.name, sum(self.rows), rows,
            )  # fmt: skip
            self.fit.rows = rows

    def _probe(self) -> None:
        """One more batch ran in parts without running out: after ``PROBE_AFTER`` in a row
        the limit doubles (none once it covers every batch the model takes)."""
        fit = self.fit
        fit.streak += 1
        if fit.streak < PROBE_AFTER:
            return
        fit.streak = 0
        fit.rows *= 2
        log.info(
            "%s: %d batches ran in parts without running out of memory; batches of up to "
            "%d rows are tried from now on",
            self.name, PROBE_AFTER, fit.rows,
        )  # fmt: skip


def _same_fault(exc: Exception, first: Exception | None, second: Exception | None) -> bool:
    """Whether both halves failed with the batch's own words: a broken model, or several
    requests raising the same words. Never for InvalidInput: the model named a request's
    input, so it is the requests' own."""
    if first is None or second is None or isinstance(exc, InvalidInput):
        return False
    return same_fault(first, exc) and same_fault(second, exc)


def _zeros(request: Mapping[str, np.ndarray], names: Sequence[str]) -> Arrays:
    """A request shaped like ``request`` holding zeros (empty bytes for a BYTES tensor)."""
    return {
        n: np.full(request[n].shape, b"", object)
        if request[n].dtype == object
        else np.zeros_like(request[n])
        for n in names
    }


_FITS: weakref.WeakKeyDictionary[object, Fit] = weakref.WeakKeyDictionary()


def _fit_of(runner: object) -> Fit:
    """The rows that fitted ``runner``'s device, kept as long as the runner lives."""
    try:
        return _FITS.setdefault(runner, Fit())
    except TypeError:  # not weakly referable: nothing is remembered across calls
        return Fit()


def device_lost(runner: object) -> str | None:
    """``device lost: <CUDA's words>`` once a batch of ``runner`` (run by ``run_requests``)
    raised a sticky CUDA error; None while its device serves."""
    fit = _FITS.get(runner) if _weakly(runner) else None
    return fit.lost if fit is not None else None


def _weakly(runner: object) -> bool:
    try:
        weakref.ref(runner)
    except TypeError:
        return False
    return True


def _within(members: list[int], rows: Sequence[int], most: int) -> list[list[int]]:
    """``members`` in consecutive parts of at most ``most`` rows (a larger request alone)."""
    parts: list[list[int]] = [[]]
    held = 0
    for i in members:
        if parts[-1] and held + rows[i] > most:
            parts.append([])
            held = 0
        parts[-1].append(i)
        held += rows[i]
    return parts


def drive(steps: Steps, fn: BatchFn) -> list[Arrays | ServekitError]:
    """Run ``steps`` with a blocking batch function."""
    try:
        inputs = next(steps)
        while True:
            try:
                outputs = fn(inputs)
            except Exception as exc:
                inputs = steps.throw(exc)
            else:
                inputs = steps.send(outputs)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def drive_async(
    steps: Steps, fn: Callable[[Mapping[str, np.ndarray]], Awaitable[Mapping[str, np.ndarray]]]
) -> list[Arrays | ServekitError]:
    """Run ``steps`` with a coroutine batch function."""
    try:
        inputs = next(steps)
        while True:
            try:
                outputs = await awaited(fn(inputs))
            except Exception as exc:
                inputs = steps.throw(exc)
            else:
                inputs = steps.send(outputs)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def run_requests(
    runner: object,
    requests: Sequence[Mapping[str, np.ndarray]],
    spec: ModelSpec | None = None,
    *,
    name: str = "",
) -> list[Arrays | ServekitError]:
    """One result per request: its outputs, or the ``ServekitError`` that belongs to it alone.

    Args:
        runner: a Runner (its ``spec`` is used unless ``spec`` is given).
        requests: each a dict of input arrays with the batch dim first.
        name: the model's, for the log of its failures.
    """
    spec = spec or runner.spec  # type: ignore[attr-defined]
    fn = batch_function(runner)  # type: ignore[arg-type]
    staging = staging_of(runner, spec)
    fit = _fit_of(runner)
    names = [t.name for t in spec.inputs]
    results: list[Arrays | ServekitError | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    rows: list[int] = [0] * len(requests)
    for i, inputs in enumerate(requests):
        try:
            rows[i] = spec.validate_inputs(inputs)
        except InvalidInput as exc:
            results[i] = exc
            continue
        key = tuple(inputs[n].shape[1:] for n in names)
        groups.setdefault(key, []).append(i)
    limit = spec.max_batch_size or 1
    for members in groups.values():
        chunk: list[int] = []
        chunk_rows = 0
        for i in members:  # never more than max_batch_size rows in one call
            if chunk and (chunk_rows + rows[i] > limit or not spec.batched):
                _run_group(fn, spec, requests, chunk, rows, results, names, staging, fit, name)
                chunk, chunk_rows = [], 0
            chunk.append(i)
            chunk_rows += rows[i]
        if chunk:
            _run_group(fn, spec, requests, chunk, rows, results, names, staging, fit, name)
    return results  # type: ignore[return-value]


def _run_group(
    fn: BatchFn,
    spec: ModelSpec,
    requests: Sequence[Mapping[str, np.ndarray]],
    members: list[int],
    rows: list[int],
    results: list[Arrays | ServekitError | None],
    names: list[str],
    staging: Lends,
    fit: Fit,
    name: str,
) -> None:
    steps = batch_steps(
        [requests[i] for i in members],
        [rows[i] for i in members],
        names,
        spec.check_outputs,
        name,
        staging=staging,
        fit=fit,
    )
    try:
        parts = drive(steps, fn)
    except ServekitError as exc:
        parts = [exc] * len(members)
    for i, part in zip(members, parts, strict=True):
        results[i] = part
