"""A queued request: typed and slotted, never a tuple."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["Request"]

Future = asyncio.Future | concurrent.futures.Future


@dataclass(slots=True, eq=False)
class Request:
    """One caller's inputs plus what the scheduler needs to place them in a batch."""

    id: int
    inputs: Mapping[str, np.ndarray]
    rows: int
    shape_key: tuple[tuple[int, ...], ...]
    """Non-batch dims of every input, in spec order: equal keys may share a batch."""
    level: int
    arrival: float
    deadline: float
    """Absolute time (batcher clock) after which the queue policy's timeout applies; inf = none."""
    future: Future
    expired: bool = False
    """Timed out under ``TimeoutAction.DELAY``: now waits behind unexpired requests."""
    taken: bool = False
    """Removed from the queue into a batch (or failed)."""

    def done(self) -> bool:
        return self.future.done()

    def resolve(self, outputs: dict[str, np.ndarray]) -> None:
        """Deliver outputs unless the caller already gave up (a cancelled future stays so)."""
        try:
            if not self.future.done():
                self.future.set_result(outputs)
        except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
            pass  # cancelled from another thread between the check and the set

    def fail(self, exc: BaseException) -> None:
        try:
            if not self.future.done():
                self.future.set_exception(exc)
        except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
            pass
