"""Staging: the buffers a runner lends the batcher, so a batch is assembled without allocating.

A batch of requests must become one array per input before a model runs it. Concatenating
allocates a batch-sized array every batch (a 77 MB one for 128 ResNet-50 images), and
the page faults of a fresh allocation cost more than the copy. Instead each runner owns
a ``StagingPool``: a batch borrows one ``Staging`` (one reused buffer per input), its
requests' rows are copied straight into it, and it goes back once the batch's outputs
are safe. A CUDA runner's pool allocates page-locked (pinned) host memory, from which
the host-to-device copy is one asynchronous DMA (Triton's pinned memory pool).

A request read from CUDA shared memory (``device.DeviceTensor``) is gathered on its
device instead (``device.gather_on_device``): its rows never cross the host, and a batch
of requests that all want their outputs there stays a ``DeviceTensor`` that says so.

Each staging keeps one buffer per input of the model (grown, never evicted: a model with
many inputs reuses every one), freed when the pool closes; a pinned pool allocates its
stagings for the model's fixed-shape inputs up front, one per lane, so the first live
batches allocate nothing either. ``pinned_bytes`` is what a pool holds page-locked.

The contract for runners: a batch's input arrays are valid for the call only (they are
the next batch's buffers); an output that shares their memory is copied before it leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import numpy as np

from ..device import DeviceTensor, gather_on_device
from ..errors import ModelNotReady

__all__ = ["Allocator", "Lends", "Staging", "StagingPool"]

Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]
"""Makes an uninitialised host array of a shape and dtype (``np.empty``, or pinned memory)."""
Free = Callable[[np.ndarray], None]
"""Gives back an array an ``Allocator`` made (pinned memory's ``cudaFreeHost``)."""


class Lends(Protocol):
    """What lends a batch its staging (a ``StagingPool``; a versioned runner's, which
    holds the serving version while the batch does)."""

    @property
    def pinned(self) -> bool: ...

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes held (0 for plain host memory)."""
        ...

    def lend(self) -> AbstractContextManager[Staging]: ...


def _empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype)


def _nothing(buffer: np.ndarray) -> None:
    """Host memory goes with its last reference."""


class Staging:
    """One batch's input buffers, reused batch after batch (never two batches at once).

    Each input keeps one buffer (bytes, viewed as its dtype and rows); it grows by doubling
    up to the pool's row limit, the old one given back, so a steady load allocates nothing.
    """

    __slots__ = ("_alloc", "_free", "_buffers", "_limit", "pinned", "allocations")

    def __init__(self, limit: int, alloc: Allocator, pinned: bool, free: Free = _nothing) -> None:
        self._limit, self._alloc, self.pinned, self._free = limit, alloc, pinned, free
        self._buffers: dict[str, np.ndarray] = {}
        self.allocations = 0
        """Buffers allocated so far (tests read it: it stops growing once warm)."""

    @property
    def nbytes(self) -> int:
        """Bytes this staging's buffers hold."""
        return sum(b.nbytes for b in self._buffers.values())

    def reserve(self, name: str, dtype: np.dtype, row: tuple[int, ...]) -> None:
        """Allocate ``name``'s buffer for the pool's most rows now, not at a first batch."""
        self._buffer(name, np.dtype(dtype), row, self._limit)

    def release(self) -> None:
        """Give every buffer back (the pool is closing; no batch holds this staging)."""
        buffers, self._buffers = list(self._buffers.values()), {}
        for b in buffers:
            self._free(b)

    def gather(
        self, inputs: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]
    ) -> dict[str, np.ndarray]:
        """The batch's inputs: every request's rows copied once into this staging's buffers
        (views of them, ``rows`` long). A single request is passed through uncopied where
        the memory is plain host memory and it is contiguous already; object (BYTES)
        tensors are concatenated, so no buffer keeps old requests' objects alive."""
        if len(inputs) == 1 and not self.pinned:
            one = inputs[0]
            if all(
                isinstance(one[n], np.ndarray)
                and (one[n].flags.c_contiguous or one[n].dtype == object)
                for n in names
            ):
                return dict(one)
        out: dict[str, np.ndarray] = {}
        for name in names:
            parts = [x[name] for x in inputs]
            first = parts[0]
            if any(isinstance(p, DeviceTensor) for p in parts):
                out[name] = gather_on_device(parts)  # type: ignore[assignment]
                continue
            if first.dtype == object:
                out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
                continue
            rows = sum(len(p) for p in parts)
            buf = self._buffer(name, first.dtype, first.shape[1:], rows)
            if buf is None:  # more rows than the model's limit: the caller's problem to report
                out[name] = np.concatenate(parts)
                continue
            out[name] = np.concatenate(parts, out=buf)
        return out

    def _buffer(
        self, name: str, dtype: np.dtype, row: tuple[int, ...], rows: int
    ) -> np.ndarray | None:
        """``rows`` rows of ``row`` in ``name``'s buffer (a view of its bytes), grown when
        they do not fit; None past the pool's row limit."""
        if rows > self._limit:
            return None
        row_bytes = int(np.prod(row, dtype=np.int64)) * dtype.itemsize
        buf = self._buffers.get(name)
        held = buf.nbytes if buf is not None else 0
        if buf is None or held < rows * row_bytes:
            size = max(held // row_bytes * 2 if row_bytes and held else 1, 1)
            while size < rows:
                size *= 2
            size = min(size, self._limit)
            new = self._alloc((max(size * row_bytes, 1),), np.dtype(np.uint8))
            if buf is not None:
                self._free(buf)
            self._buffers[name] = buf = new
            self.allocations += 1
        return buf[: rows * row_bytes].view(dtype).reshape((rows, *row))

    def detach(self, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``outputs`` safe to hand out: any that may share memory with a buffer (a model
        that returns its input, or a view of it) is copied, as the next batch reuses it."""
        result = dict(outputs)
        if not self._buffers:
            return result
        buffers = self._buffers.values()
        for name, value in outputs.items():
            if isinstance(value, np.ndarray) and any(
                np.may_share_memory(value, b) for b in buffers
            ):
                result[name] = value.copy()
        return result


class StagingPool:
    """A runner's stagings: one per batch in flight on it (an instance each, in steady state).

    Args:
        limit: the most rows a batch holds (the model's max batch size; 0 for one).
        alloc: how a buffer is allocated (``np.empty``; a CUDA runner's pinned allocator).
        pinned: whether ``alloc`` gives page-locked memory: then a single request is
            copied in too, so the device copy is asynchronous from pinned memory.
    """

    def __init__(
        self,
        limit: int,
        alloc: Allocator | None = None,
        *,
        pinned: bool = False,
        free: Free | None = None,
        inputs: Sequence[tuple[str, np.dtype, tuple[int, ...]]] = (),
        lanes: int = 0,
    ) -> None:
        self.limit, self.pinned = max(limit, 1), pinned
        self._alloc, self._give = alloc or _empty, free or _nothing
        self._free: list[Staging] = []
        self._all: list[Staging] = []
        self._lock = threading.Lock()
        self._closed = False
        for _ in range(lanes):  # the model's fixed-shape inputs, one staging per lane
            staging = self._new()
            for name, dtype, row in inputs:
                if -1 not in row and np.dtype(dtype) != object:
                    staging.reserve(name, np.dtype(dtype), row)
            self._free.append(staging)

    def _new(self) -> Staging:
        staging = Staging(self.limit, self._alloc, self.pinned, self._give)
        self._all.append(staging)
        return staging

    @contextmanager
    def lend(self) -> Iterator[Staging]:
        """Borrow a staging for one batch, returned on exit (thread-safe)."""
        with self._lock:
            if self._closed:
                raise ModelNotReady("the runner is closed: its staging buffers are freed")
            staging = self._free.pop() if self._free else self._new()
        try:
            yield staging
        finally:
            with self._lock:
                self._free.append(staging)

    @property
    def allocations(self) -> int:
        """Buffers allocated by every staging of this pool so far."""
        with self._lock:
            return sum(s.allocations for s in self._all)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes this pool holds (0 for plain host memory)."""
        if not self.pinned:
            return 0
        with self._lock:
            return sum(s.nbytes for s in self._all)

    def close(self) -> None:
        """Give every buffer back; the runner's batches are over (it is closing)."""
        with self._lock:
            self._closed = True
            stagings, self._all, self._free = self._all, [], []
        for staging in stagings:
            staging.release()
