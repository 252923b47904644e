"""A Runner whose model can be replaced while it serves: live updates without a reload.

Every runtime that holds a Runner in its own process (PyTriton's infer callables, the
in-process Batcher, a KServe front) gets zero-downtime updates from this one class:
``update`` loads and warms the new version off the request path, then swaps it in
between batches. Each batch runs wholly on the version it started with, so no answer
mixes versions; the replaced version is closed once its last batch has finished and
the one before it is kept warm for ``rollback``. An update that fails to load or to
warm up raises and leaves the serving version untouched.

A batch's staging (``staging``) is lent by the version serving when the batch is
gathered, and holds that version open until it is given back: a version's pinned memory
is freed only once no batch holds it, however many updates came meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UpdateRefused
from ..spec import ModelSpec
from .base import Arrays, Runner, accelerated, batch_function, staging_of, tensor_device
from .staging import Lends, Staging

__all__ = ["UpdateRefused", "VersionedRunner", "check_compatible"]


def check_compatible(serving: ModelSpec, new: ModelSpec, name: str = "model") -> None:
    """Raise ``UpdateRefused`` unless ``new`` accepts every request ``serving`` accepts and
    answers with the same outputs: clients and the runtime's config stay valid."""
    for kind, old_t, new_t in (
        ("inputs", serving.inputs, new.inputs),
        ("outputs", serving.outputs, new.outputs),
    ):
        if old_t != new_t:
            raise UpdateRefused(
                f"{name}: the new version's {kind} differ: expected "
                f"{[t.describe() for t in old_t]}, got {[t.describe() for t in new_t]}"
            )
    if new.max_batch_size < serving.max_batch_size:
        raise UpdateRefused(
            f"{name}: the new version's max_batch_size must be at least "
            f"{serving.max_batch_size}, got {new.max_batch_size}"
        )


@dataclass
class _Version:
    number: int
    runner: Runner
    in_flight: int = 0
    retired: bool = False
    closed: bool = False
    pool: Lends | None = None
    """The runner's staging (``staging_of``), taken once."""


class VersionedRunner:
    """Serves one version of a model at a time; ``update``/``rollback`` swap between batches."""

    def __init__(self, runner: Runner, *, name: str = "model", version: int = 1) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._current = _Version(version, runner)
        self._previous: _Version | None = None
        self._spec = runner.spec
        self.origin: object = None
        """What the serving version was loaded from (its cached file, for a model from
        object storage): a reload from the same origin has nothing to swap."""

    @property
    def spec(self) -> ModelSpec:
        """The signature every version shares (the first version's)."""
        return self._spec

    @property
    def metadata(self) -> dict[str, str]:
        """The serving version's model metadata (labels and input scaling of zoo models)."""
        return dict(getattr(self._current.runner, "metadata", None) or {})

    @property
    def version(self) -> int:
        """The version new batches run on."""
        return self._current.number

    @property
    def runner(self) -> Runner:
        """The serving version's runner."""
        return self._current.runner

    def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        with self._lock:
            v = self._current
            v.in_flight += 1
        try:
            return v.runner.infer(inputs)
        finally:
            self._release(v)

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """A batch its caller validated (a Batcher, ``run_requests``) on the serving version,
        checked no second time: the version's own ``run`` (``batch_function``)."""
        with self._lock:
            v = self._current
            v.in_flight += 1
        try:
            return dict(batch_function(v.runner)(inputs))
        finally:
            self._release(v)

    def warmup(self) -> None:
        self._current.runner.warmup()

    @property
    def staging(self) -> _VersionedStaging:
        """Stagings lent by the version serving at each batch (``runners.staging``)."""
        return _VersionedStaging(self)

    @contextmanager
    def _lend(self) -> Iterator[Staging]:
        with self._lock:
            v = self._current
            v.in_flight += 1
        try:
            if v.pool is None:
                v.pool = staging_of(v.runner, v.runner.spec)
            with v.pool.lend() as staging:
                yield staging
        finally:
            self._release(v)

    @property
    def tensor_device(self) -> Any:
        """The serving version's (``runners.base.tensor_device``)."""
        return tensor_device(self._current.runner)

    @property
    def accelerated(self) -> bool:
        """The serving version's (``runners.base.accelerated``)."""
        return accelerated(self._current.runner)

    @property
    def broken(self) -> str | None:
        """Why the serving version cannot serve (``runners.broken``); None while it can."""
        from .broken import broken

        return broken(self._current.runner)

    @property
    def decoupled(self) -> bool:
        """Whether the serving version answers a request with any number of responses."""
        return bool(getattr(self._current.runner, "decoupled", False))

    def responses(self, inputs: Mapping[str, np.ndarray]) -> Iterator[Arrays]:
        """A decoupled model's responses, from the version serving when the request began."""
        with self._lock:
            v = self._current
            v.in_flight += 1
        try:
            yield from v.runner.responses(inputs)  # type: ignore[attr-defined]
        finally:
            self._release(v)

    def end_sequence(self, sequence_id: int | str, reason: str) -> None:
        """Tell the serving version's model a sequence ended, where it listens."""
        tell = getattr(self._current.runner, "end_sequence", None)
        if callable(tell):
            tell(sequence_id, reason)

    def update(self, runner: Runner, version: int | None = None) -> int:
        """Serve ``runner`` from the next batch on; returns its version number.

        Checks the signature and warms the new runner up first: any failure there
        closes it and re-raises, and the serving version never stops.
        """
        try:
            check_compatible(self._spec, runner.spec, self.name)
            runner.warmup()
        except BaseException:
            runner.close()
            raise
        with self._lock:
            number = self._current.number + 1 if version is None else version
            stale, self._previous = self._previous, self._current
            self._current = _Version(number, runner)
            self._previous.retired = True
        if stale is not None:
            stale.retired = True
            self._release(stale, acquired=False)
        return number

    def rollback(self) -> int:
        """Serve the version before the current one again (kept warm); returns its number."""
        with self._lock:
            if self._previous is None:
                raise UpdateRefused(f"{self.name}: no previous version to roll back to")
            self._current, self._previous = self._previous, self._current
            self.origin = None
            self._current.retired = False
            self._previous.retired = True
            return self._current.number

    def _release(self, v: _Version, acquired: bool = True) -> None:
        """Drop one batch's hold on ``v``; close it once it is retired, idle and not kept."""
        with self._lock:
            if acquired:
                v.in_flight -= 1
            close = (
                v.retired
                and v.in_flight == 0
                and not v.closed
                and v is not self._previous
                and v is not self._current
            )
            if close:
                v.closed = True
        if close:
            v.runner.close()

    def close(self) -> None:
        for v in (self._current, self._previous):
            if v is not None and not v.closed:
                v.closed = True
                v.runner.close()


class _VersionedStaging:
    """A ``VersionedRunner``'s stagings (``staging.Lends``): each lent by the version
    serving then, which stays open while the batch holds it."""

    def __init__(self, runner: VersionedRunner) -> None:
        self._runner = runner

    @property
    def pinned(self) -> bool:
        return staging_of(self._runner.runner, self._runner.spec).pinned

    @property
    def pinned_bytes(self) -> int:
        """What the serving version's pool holds page-locked."""
        return staging_of(self._runner.runner, self._runner.spec).pinned_bytes

    def lend(self) -> AbstractContextManager[Staging]:
        return self._runner._lend()
