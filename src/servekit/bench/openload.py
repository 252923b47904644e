"""An open-loop load whose rate changes over time: requests due at Poisson arrivals of
``rate_at(seconds since the start)``, sent whatever the answers do, each one recorded.

What the benchmarks that shape a load use (``bench/autoscale.py``'s ramp,
``bench/budget.py``'s steps); latency counts from when a request was due.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import numpy as np

from ..client import AsyncClient

__all__ = ["OpenLoad"]


class OpenLoad:
    """Requests of ``inputs`` to ``model`` at ``url`` for ``seconds``, over ``clients``
    connections; ``done`` holds (sent, latency, answered) per request, sent in seconds
    from ``start``."""

    def __init__(
        self,
        url: str,
        model: str,
        inputs: Mapping[str, np.ndarray],
        rate_at: Callable[[float], float],
        seconds: float,
        *,
        clients: int = 8,
        seed: int = 0,
    ) -> None:
        self.url, self.model, self.inputs = url, model, inputs
        self.rate_at, self.seconds = rate_at, seconds
        self.clients, self.seed = clients, seed
        self.start = 0.0
        self.sent: list[float] = []
        self.done: list[tuple[float, float, bool]] = []

    async def run(self, *beside: Callable[[OpenLoad], Coroutine[Any, Any, None]]) -> None:
        """Send until ``seconds`` have passed, with each of ``beside`` running alongside
        (samplers reading ``done``), then wait for every answer."""
        pool = [AsyncClient(self.url, timeout_s=60) for _ in range(self.clients)]
        prepared = pool[0].prepare(dict(self.inputs))
        rng = random.Random(self.seed)
        tasks: set[asyncio.Task] = set()
        self.start = start = time.perf_counter()

        async def one(k: int, due: float) -> None:
            try:
                await pool[k % len(pool)].infer_prepared(self.model, prepared)
                ok = True
            except Exception:
                ok = False
            self.done.append((due - start, time.perf_counter() - due, ok))

        others: list[asyncio.Task[None]] = [asyncio.create_task(b(self)) for b in beside]
        due, k = start, 0
        while (now := time.perf_counter()) - start < self.seconds:
            due += rng.expovariate(self.rate_at(due - start))
            if due > now:
                await asyncio.sleep(due - now)
            self.sent.append(due - start)
            task = asyncio.create_task(one(k, due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            k += 1
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*others)
        for c in pool:
            await c.close()
