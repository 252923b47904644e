"""Lanes: one instance's own share of a device (its stream, graphs, static buffers).

A runner served with ``instances = N`` on one GPU runs N batches at once, as Triton's
instance groups do: each batch takes a free lane for its run, so the host-to-device
copy of one lane's batch overlaps another lane's compute, and no lock spans lanes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["Lanes"]

T = TypeVar("T")


class Lanes(Generic[T]):
    """``count`` lanes made by ``make(index)``; ``use`` takes a free one, waiting while
    every lane runs a batch."""

    def __init__(self, make: Callable[[int], T], count: int) -> None:
        if count < 1:
            raise ValueError(f"a runner needs at least one lane, got {count}")
        self.all: tuple[T, ...] = tuple(make(i) for i in range(count))
        self._free = list(self.all)
        self._ready = threading.Condition()

    @contextmanager
    def use(self) -> Iterator[T]:
        with self._ready:
            while not self._free:
                self._ready.wait()
            lane = self._free.pop()
        try:
            yield lane
        finally:
            with self._ready:
                self._free.append(lane)
                self._ready.notify()

    def __len__(self) -> int:
        return len(self.all)
