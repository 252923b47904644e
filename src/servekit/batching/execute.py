"""Run requests that a server already grouped (Triton, PyTriton, Ray), each failing alone.

Servers hand a backend a list of requests; one bad request must not fail the others.
``run_requests`` validates each, batches the valid ones by shape, and when a batch
raises ``InvalidInput`` (a bad image found only while decoding, say) re-runs its
requests one by one so only the culprit fails.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence

import numpy as np

from ..errors import InvalidInput, RunnerError, ServekitError
from ..runners.base import batch_function, staging_of
from ..runners.staging import Staging, StagingPool
from ..spec import ModelSpec
from .concat import concat, split

__all__ = ["BatchFn", "Steps", "as_error", "batch_steps", "drive", "drive_async", "run_requests"]

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


def batch_steps(
    requests: Sequence[Mapping[str, np.ndarray]],
    rows: Sequence[int],
    names: Sequence[str],
    check: Callable[[Mapping[str, np.ndarray], int], None],
    name: str = "",
    staging: StagingPool | None = None,
) -> Steps:
    """Run ``requests`` as one batch, ``check`` its outputs and split them. When the batch
    raises ``InvalidInput`` (a bad image found only while decoding, say), run them one by
    one so only the culprit fails. Any other failure fails the batch: raised, whole.

    With ``staging`` (the runner's, ``runners.staging``) the batch is gathered into a
    borrowed staging's reused buffers instead of new arrays, and returned after its
    outputs no longer share them.

    The one execution path of every batch, driven by ``drive`` (threads) or
    ``drive_async`` (coroutine models)."""
    if staging is None:
        return (yield from _steps(requests, rows, names, check, name, None))
    with staging.lend() as borrowed:
        return (yield from _steps(requests, rows, names, check, name, borrowed))


def _steps(
    requests: Sequence[Mapping[str, np.ndarray]],
    rows: Sequence[int],
    names: Sequence[str],
    check: Callable[[Mapping[str, np.ndarray], int], None],
    name: str,
    staging: Staging | None,
) -> Steps:
    gather = concat if staging is None else staging.gather
    try:
        outputs = yield gather(requests, names)
        if staging is not None:
            outputs = staging.detach(outputs)
        check(outputs, sum(rows))
        return split(outputs, rows)  # type: ignore[return-value]
    except InvalidInput:
        if len(requests) == 1:
            raise
    except ServekitError:
        raise
    except Exception as exc:
        raise as_error(exc, name) from exc
    results: list[Arrays | ServekitError] = []
    for one, n in zip(requests, rows, strict=True):
        try:
            outputs = yield gather([one], names)
            if staging is not None:
                outputs = staging.detach(outputs)
            check(outputs, n)
            results.append(split(outputs, [n])[0])
        except Exception as exc:
            results.append(as_error(exc, name))
    return results


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
                outputs = await fn(inputs)
            except Exception as exc:
                inputs = steps.throw(exc)
            else:
                inputs = steps.send(outputs)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def run_requests(
    runner: object, requests: Sequence[Mapping[str, np.ndarray]], spec: ModelSpec | None = None
) -> list[Arrays | ServekitError]:
    """One result per request: its outputs, or the ``ServekitError`` that belongs to it alone.

    Args:
        runner: a Runner (its ``spec`` is used unless ``spec`` is given).
        requests: each a dict of input arrays with the batch dim first.
    """
    spec = spec or runner.spec  # type: ignore[attr-defined]
    fn = batch_function(runner)  # type: ignore[arg-type]
    staging = staging_of(runner, spec)
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
                _run_group(fn, spec, requests, chunk, rows, results, names, staging)
                chunk, chunk_rows = [], 0
            chunk.append(i)
            chunk_rows += rows[i]
        if chunk:
            _run_group(fn, spec, requests, chunk, rows, results, names, staging)
    return results  # type: ignore[return-value]


def _run_group(
    fn: BatchFn,
    spec: ModelSpec,
    requests: Sequence[Mapping[str, np.ndarray]],
    members: list[int],
    rows: list[int],
    results: list[Arrays | ServekitError | None],
    names: list[str],
    staging: StagingPool,
) -> None:
    steps = batch_steps(
        [requests[i] for i in members],
        [rows[i] for i in members],
        names,
        spec.check_outputs,
        staging=staging,
    )
    try:
        parts = drive(steps, fn)
    except ServekitError as exc:
        parts = [exc] * len(members)
    for i, part in zip(members, parts, strict=True):
        results[i] = part
