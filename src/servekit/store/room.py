"""The store's memory budget and its housekeeping (``Room``, a mixin of ``ModelStore``):
room made for a load by evicting the least recently used models nobody holds, loads
paced and dropped when no request waits any more, models closed and their Batchers
stopped, and the events log."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ModelNotReady, Overloaded
from .unit import MB, READY, UNAVAILABLE, UNLOADING, Dropped, Resident, Unit, release_served

__all__ = ["Room"]

log = logging.getLogger("servekit.store.store")


class Room:
    """Budget and housekeeping of a ``ModelStore`` (whose state it reads)."""

    budget: int
    pin: frozenset[str]
    wait_s: float
    max_loads_per_s: float
    events: collections.deque[dict[str, Any]]
    _entries: dict[str, Unit]
    _load_lock: asyncio.Lock | None
    _room: asyncio.Event | None
    _closing: bool
    _last_load: float
    _unwatch: Callable[[str, str], None]

    if TYPE_CHECKING:  # the store's own; declared for the type checker only

        def resident(self) -> dict[str, Resident]: ...

        @property
        def resident_bytes(self) -> int: ...

    def _lock(self) -> asyncio.Lock:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        return self._load_lock

    def _room_event(self) -> asyncio.Event:
        if self._room is None:
            self._room = asyncio.Event()
        return self._room

    def _freed(self) -> None:
        """Something may have come free (a model nobody holds, an unload, a load ended):
        wake the load waiting for room."""
        self._room_event().set()

    def _still_wanted(self, entry: Unit) -> None:
        if self._closing:
            raise ModelNotReady(f"model {entry.key!r} is not loaded: the server is stopping")
        if not entry.requested and entry.wanted == 0:
            raise Dropped

    async def _pace(self) -> None:
        """At most ``max_loads_per_s`` loads (and so evictions) a second."""
        if self.max_loads_per_s > 0:
            loop = asyncio.get_running_loop()
            delay = self._last_load + 1 / self.max_loads_per_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._last_load = loop.time()

    def _fits(self, name: str, charge: int) -> None:
        if self.budget and charge > self.budget:
            raise ModelNotReady(
                f"model {name!r} takes {charge / MB:.1f} MB resident (measured after its "
                f"load and warm-up), more than the whole budget of {self.budget / MB:.1f} MB"
            )

    async def _make_room(self, entry: Unit, needed: int) -> None:
        """Evict least recently used models that nobody holds and that are not pinned,
        until ``needed`` bytes fit; while none can go, wait for one to: a load on demand
        as long as requests wait for it (then it is dropped), one asked for ``wait_s``."""
        if not self.budget:
            return
        name = entry.key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        room = self._room_event()
        while self.resident_bytes + needed > self.budget:
            if self._closing:
                raise ModelNotReady(f"model {name!r} is not loaded: the server is stopping")
            idle = [
                (e.resident.last_used, n)
                for n, e in self._entries.items()
                if e.resident is not None and e.state == READY and e.wanted == 0
                and e.model not in self.pin and n != name
            ]  # fmt: skip
            if idle:
                await self._evict(min(idle)[1], name)
                continue
            self._still_wanted(entry)
            remaining = deadline - loop.time() if entry.requested else None
            if remaining is not None and remaining <= 0:
                held = {n: round(r.charged / MB, 1) for n, r in sorted(self.resident().items())}
                raise Overloaded(
                    f"model {name!r} needs {needed / MB:.1f} MB and the budget of "
                    f"{self.budget / MB:.1f} MB is held by models in use or pinned (MB: {held})",
                    retry_after_s=1.0,
                )
            room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.wait(), remaining)

    async def _evict(self, victim: str, name: str) -> None:
        entry = self._entries[victim]
        entry.state, entry.reason = UNLOADING, f"evicted (least recently used) for {name}"
        entry.unloaded.clear()
        try:
            await self._close(entry)
        finally:
            entry.state = UNAVAILABLE
            entry.unloaded.set()
        entry.counts["evictions"] += 1
        self._event("evict", entry, why=f"room for {name}", freed_bytes=entry.charge)

    async def _close(self, entry: Unit) -> None:
        resident, entry.resident = entry.resident, None
        if resident is not None:
            for served_name in resident.batchers:
                self._unwatch(served_name, str(entry.number))
            await self._release(resident)

    async def _release(self, resident: Resident) -> None:
        for batcher in resident.batchers.values():
            await batcher.aclose()
        await release_served(resident.served)

    def _event(self, kind: str, entry: Unit, **details: Any) -> None:
        event = {
            "time": round(time.time(), 3), "event": kind, "model": entry.model,
            "version": entry.number, **details,
        }  # fmt: skip
        self.events.append(event)
        log.info("store: %s %s %s", kind, entry.key, details or "")
