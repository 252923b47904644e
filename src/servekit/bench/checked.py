"""Steady load whose every answer is checked: add_sub with random inputs, from threads.

What the crashed-worker tests and ``bench/recovery.py`` drive a server with while they
kill its workers: each request's answer is compared with the inputs' sum and
difference, and each outcome (right, wrong, failed with its message) is kept with the
latency of the right ones.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..client import Client

__all__ = ["CheckedLoad"]


class CheckedLoad:
    """``clients`` threads sending add_sub requests to ``url`` until the ``with`` ends."""

    def __init__(self, url: str, clients: int = 4, model: str = "add_sub") -> None:
        self.url, self.model, self.stop = url, model, threading.Event()
        self.ok = self.wrong = 0
        self.failures: list[str] = []
        self.latencies: list[float] = []
        """Seconds each right answer took."""
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(self.url) as client:
            while not self.stop.is_set():
                a, b = rng.random((2, 1, 16), dtype=np.float32)
                start = time.perf_counter()
                failure: str | None = None
                try:
                    out = client.infer(self.model, {"INPUT0": a, "INPUT1": b})
                    right = np.allclose(out["OUTPUT0"], a + b) and np.allclose(
                        out["OUTPUT1"], a - b
                    )
                except Exception as exc:
                    right, failure = False, str(exc)[:300]
                with self._lock:
                    if right:
                        self.ok += 1
                        self.latencies.append(time.perf_counter() - start)
                    elif failure is None:
                        self.wrong += 1
                    else:
                        self.failures.append(failure)

    def __enter__(self) -> CheckedLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(120)
