"""``ResponseCache``: answers looked up before a model runs and kept after it succeeds,
with Triton's per-model metrics whose counts add up to the lookups."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .query import Query, decode_tensors, encode_tensors
from .stores import Store

__all__ = ["CACHE_METRICS", "ResponseCache"]


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    hit_us: float = 0.0
    miss_us: float = 0.0
    collisions: int = 0


CACHE_METRICS: dict[str, tuple[str, str, Callable[[_Counts], float]]] = {
    "nv_cache_num_hits_per_model": (
        "counter", "Response cache hits per model", lambda c: c.hits,
    ),
    "nv_cache_num_misses_per_model": (
        "counter", "Response cache misses per model", lambda c: c.misses,
    ),
    "nv_cache_hit_duration_per_model": (
        "counter", "Total time of the lookups that hit, per model (us)", lambda c: c.hit_us,
    ),
    "nv_cache_miss_duration_per_model": (
        "counter",
        "Total time of the lookups that missed and of the insertions after them, per model (us)",
        lambda c: c.miss_us,
    ),
    "servekit_cache_collisions_total": (
        "counter",
        "Lookups whose key held another query's entry, or one that does not decode (a miss)",
        lambda c: c.collisions,
    ),
}  # fmt: skip
"""Triton's names (its cache's per-model metrics), and the collisions Triton cannot see."""


class ResponseCache:
    """``lookup`` before running a model, ``insert`` after it answered successfully."""

    def __init__(self, store: Store, clock: Callable[[], float] = time.perf_counter) -> None:
        self.store, self._clock = store, clock
        self._counts: dict[str, _Counts] = {}

    def _of(self, model: str) -> _Counts:
        counts = self._counts.get(model)
        if counts is None:
            counts = self._counts[model] = _Counts()
        return counts

    async def lookup(self, query: Query) -> dict[str, np.ndarray] | None:
        """The answer kept for exactly this query, or None (a miss; ``insert`` follows)."""
        start = self._clock()
        counts = self._of(query.model)
        entry = await self.store.get(query.key())
        if entry is not None:
            answer = _answer_to(query, entry)
            if answer is not None:
                counts.hits += 1
                counts.hit_us += (self._clock() - start) * 1e6
                return answer
            counts.collisions += 1
        counts.misses += 1
        counts.miss_us += (self._clock() - start) * 1e6
        return None

    async def insert(self, query: Query, answer: dict[str, np.ndarray]) -> None:
        """Keep a successful ``answer`` to ``query`` (its time counts with the miss)."""
        start = self._clock()
        asked = query.encode()
        entry = struct.pack("<Q", len(asked)) + asked + encode_tensors(answer)
        await self.store.put(query.key(), entry)
        self._of(query.model).miss_us += (self._clock() - start) * 1e6

    async def invalidate(self, model: str) -> int:
        """Forget ``model``'s answers (a reload, a new version, a promotion)."""
        return await self.store.drop(model)

    def figures(self) -> Iterable[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """The counts as Prometheus families (``Metrics.collect``)."""
        rows = sorted(self._counts.items())
        for name, (kind, about, read) in CACHE_METRICS.items():
            yield name, kind, about, [({"model": model}, float(read(c))) for model, c in rows]


def _answer_to(query: Query, entry: bytes) -> dict[str, np.ndarray] | None:
    """The answer ``entry`` keeps for exactly ``query``; None for another query's entry,
    or one that does not decode (another writer's, in a shared Redis): a miss, not a 500."""
    try:
        (n,) = struct.unpack_from("<Q", entry)
        if entry[8 : 8 + n] != query.encode():
            return None
        return decode_tensors(entry[8 + n :])
    except (struct.error, ValueError, TypeError, IndexError):
        return None
