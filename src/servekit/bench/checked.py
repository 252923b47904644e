"""Steady load whose every answer is checked, from threads: add_sub with random inputs,
or any model with fixed cases whose answers are known (``cases``: ResNet-50's, run
in-process beforehand).

What the crashed-worker tests and ``bench/recovery.py`` drive a server with while they
kill its workers: each request's answer is compared with the inputs' sum and
difference (or the case's outputs), and each outcome (right, wrong, failed with its
message) is kept with the latency of the right ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np

from ..client import Client

__all__ = ["Case", "CheckedLoad"]

Case = tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]
"""A request's inputs and the outputs it must be answered with."""


class CheckedLoad:
    """``clients`` threads sending requests to ``url`` until the ``with`` ends: add_sub's
    with random inputs, or ``cases`` picked at random (outputs equal within 1e-3)."""

    def __init__(
        self,
        url: str,
        clients: int = 4,
        model: str = "add_sub",
        cases: Sequence[Case] = (),
    ) -> None:
        self.url, self.model, self.stop = url, model, threading.Event()
        self.cases = list(cases)
        self.ok = self.wrong = 0
        self.failures: list[str] = []
        self.latencies: list[float] = []
        """Seconds each right answer took."""
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)
        ]

    def _case(self, rng: np.random.Generator) -> Case:
        if self.cases:
            return self.cases[int(rng.integers(len(self.cases)))]
        a, b = rng.random((2, 1, 16), dtype=np.float32)
        return {"INPUT0": a, "INPUT1": b}, {"OUTPUT0": a + b, "OUTPUT1": a - b}

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(self.url) as client:
            while not self.stop.is_set():
                inputs, expected = self._case(rng)
                start = time.perf_counter()
                failure: str | None = None
                try:
                    out = client.infer(self.model, dict(inputs))
                    right = all(
                        np.allclose(out[k], v, rtol=1e-3, atol=1e-3) for k, v in expected.items()
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
