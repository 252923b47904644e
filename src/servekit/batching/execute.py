"""Run requests that a server already grouped (Triton, PyTriton, Ray), each failing alone.

Servers hand a backend a list of requests; one bad request must not fail the others.
``run_requests`` validates each, batches the valid ones by shape, and when a batch
raises ``InvalidInput`` (a bad image found only while decoding, say) re-runs its
requests one by one so only the culprit fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import InvalidInput, RunnerError, ServekitError
from ..spec import ModelSpec
from .concat import concat, split

__all__ = ["run_requests"]

Arrays = dict[str, np.ndarray]


def run_requests(
    runner: object, requests: Sequence[Mapping[str, np.ndarray]], spec: ModelSpec | None = None
) -> list[Arrays | ServekitError]:
    """One result per request: its outputs, or the ``ServekitError`` that belongs to it alone.

    Args:
        runner: a Runner (its ``spec`` is used unless ``spec`` is given).
        requests: each a dict of input arrays with the batch dim first.
    """
    spec = spec or runner.spec  # type: ignore[attr-defined]
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
                _run_group(runner, spec, requests, chunk, rows, results, names)
                chunk, chunk_rows = [], 0
            chunk.append(i)
            chunk_rows += rows[i]
        if chunk:
            _run_group(runner, spec, requests, chunk, rows, results, names)
    return results  # type: ignore[return-value]


def _run_group(
    runner: object,
    spec: ModelSpec,
    requests: Sequence[Mapping[str, np.ndarray]],
    members: list[int],
    rows: list[int],
    results: list[Arrays | ServekitError | None],
    names: list[str],
) -> None:
    try:
        outputs = runner.infer(concat([requests[i] for i in members], names))  # type: ignore[attr-defined]
        parts = split(outputs, [rows[i] for i in members])
    except InvalidInput as exc:
        if len(members) == 1:
            results[members[0]] = exc
            return
        for i in members:  # find which request was bad; the others still get answers
            _run_group(runner, spec, requests, [i], rows, results, names)
        return
    except ServekitError as exc:
        for i in members:
            results[i] = exc
        return
    except Exception as exc:
        error = RunnerError(f"{type(exc).__name__}: {exc}")
        for i in members:
            results[i] = error
        return
    for i, part in zip(members, parts, strict=True):
        results[i] = part
