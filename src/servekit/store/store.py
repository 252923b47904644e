"""``ModelStore``: which models are resident, loading one on demand, and the memory budget.

Every model of the catalog is known; a resident one has its runners and a Batcher per
served name (a model and its image model). A request holds its model (``lease``) from
admission to answer, so a model with requests in flight or queued is never evicted or
unloaded under them: an unload waits for them, and an eviction picks only idle models.
Loads run one at a time, so the resident memory each one adds is its own: the process's
RSS growth across the load and warm-up (the store's first load is done twice, the first
time unmeasured, so no model is charged the engine's one-time start). RSS reads low when the allocator reuses memory
freed earlier, so a model is charged at least its file's size and at least the most any
of its loads measured. Before a load the store makes room for that charge (its file's
size the first time), after it for what it measured; a model larger than the budget
alone is refused with the figures. Concurrent requests for a model that is loading wait
on that one load.

Everything here runs on the serving event loop; loads, warm-ups and closes run on
worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..batching import Batcher
from ..config import ModelConfig, image_model_name
from ..errors import FetchFailed, ModelNotFound, ModelNotReady, Overloaded
from ..runners.versioned import VersionedRunner
from ..runtime.base import ServedModel, load_models, probe_model, refresh
from ..spec import ModelSpec
from ..storage import StorageConfig, is_remote
from .memory import release_freed, resident_bytes

__all__ = ["ModelStore", "Resident"]

log = logging.getLogger(__name__)

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
EVENTS_KEPT = 100
MB = 1024 * 1024


@dataclass
class Resident:
    """A loaded model: its served models, a Batcher for each, what it is charged, its use."""

    config: ModelConfig
    served: list[ServedModel]
    batchers: dict[str, Batcher]
    charged: int
    load_s: float
    last_used: float
    in_flight: int = 0


@dataclass
class _Entry:
    config: ModelConfig
    state: str = UNAVAILABLE
    reason: str = "not loaded yet"
    resident: Resident | None = None
    loading: asyncio.Future[None] | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no request holds the model (what an unload waits for)."""
    unloaded: asyncio.Event = field(default_factory=asyncio.Event)
    """Set unless an unload is under way."""
    charge: int | None = None
    """The resident bytes its last load measured."""
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    counts: dict[str, float] = field(
        default_factory=lambda: {"loads": 0, "unloads": 0, "evictions": 0, "load_seconds": 0.0}
    )


def _load(
    config: ModelConfig, cache_dir: str | None, storage: StorageConfig | None
) -> list[ServedModel]:
    served = load_models(config, cache_dir, storage)
    for m in served:
        m.runner.warmup()
    return served


class ModelStore:
    """The models of ``models`` (name -> config), resident within ``budget_bytes`` (0: no
    budget); ``pin``ned ones are never evicted. ``on_demand``: a request for a model not
    loaded loads it (else only ``load`` does). ``watch``/``unwatch`` are told of each
    Batcher as it comes and goes (the front's metrics)."""

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        *,
        budget_bytes: int = 0,
        pin: Iterable[str] = (),
        on_demand: bool = True,
        cache_dir: str | None = None,
        storage: StorageConfig | None = None,
        loader: Callable[[ModelConfig], list[ServedModel]] | None = None,
        watch: Callable[[str, Batcher], None] = lambda name, batcher: None,
        unwatch: Callable[[str], None] = lambda name: None,
        clock: Callable[[], float] = time.monotonic,
        measure: Callable[[], int] = resident_bytes,
        prime: bool = True,
    ) -> None:
        self.budget, self.pin, self.on_demand = budget_bytes, frozenset(pin), on_demand
        self._cache_dir, self._storage = cache_dir, storage
        self._loader = loader or (lambda config: _load(config, cache_dir, storage))
        self._watch, self._unwatch, self._clock, self._measure = watch, unwatch, clock, measure
        self._entries = {name: _Entry(config) for name, config in models.items()}
        for entry in self._entries.values():
            entry.idle.set()
            entry.unloaded.set()
        self._owner = {name: name for name in models}
        for name, config in models.items():
            if config.image:
                self._owner.setdefault(image_model_name(name), name)
        self._load_lock: asyncio.Lock | None = None
        self._primed = not prime
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)

    # ------------------------------------------------------------ what is known

    def owner(self, served: str) -> str:
        """The store's model that serves ``served`` (itself, or the model of ``<m>_image``)."""
        name = self._owner.get(served)
        if name is None:
            raise ModelNotFound(f"unknown model {served!r}; the store knows {len(self._entries)}")
        return name

    def known(self) -> list[str]:
        return sorted(self._entries)

    def config(self, name: str) -> ModelConfig:
        """The configuration ``name`` is (or will be) loaded with."""
        return self._entries[self.owner(name)].config

    def state(self, name: str) -> str:
        return self._entries[self.owner(name)].state

    def resident(self) -> dict[str, Resident]:
        return {n: e.resident for n, e in self._entries.items() if e.resident is not None}

    @property
    def resident_bytes(self) -> int:
        return sum(r.charged for r in self.resident().values())

    async def spec(self, served: str) -> ModelSpec:
        """``served``'s signature: from its last load, else read from its file once."""
        entry = self._entries[self.owner(served)]
        if served not in entry.specs:
            probe = await asyncio.to_thread(
                probe_model, entry.config, self._cache_dir, self._storage
            )
            entry.specs.setdefault(entry.config.name, probe.spec)
            if probe.image_spec is not None:
                entry.specs.setdefault(image_model_name(entry.config.name), probe.image_spec)
            if served not in entry.specs:
                raise ModelNotFound(
                    f"unknown model {served!r}: {entry.config.name} is no image classifier"
                )
        return entry.specs[served]

    # ------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def lease(self, served: str) -> AsyncIterator[Batcher]:
        """``served``'s Batcher, held (never evicted or unloaded) until the block ends;
        loads the model first where it is not resident and ``on_demand`` allows."""
        name = self.owner(served)
        entry = self._entries[name]
        while True:
            if entry.state == READY and entry.resident is not None:
                break
            if entry.state == LOADING and entry.loading is not None:
                await asyncio.shield(entry.loading)
            elif entry.state == UNLOADING:
                await entry.unloaded.wait()
            elif self.on_demand:
                await self.load(name)
            else:
                raise ModelNotReady(
                    f"model {name!r} is not loaded ({entry.reason}); load it with "
                    f"POST /v2/repository/models/{name}/load"
                )
        resident = entry.resident
        batcher = resident.batchers.get(served)
        if batcher is None:
            raise ModelNotFound(f"unknown model {served!r}: {name} is no image classifier")
        resident.in_flight += 1
        resident.last_used = self._clock()
        entry.idle.clear()
        try:
            yield batcher
        finally:
            resident.in_flight -= 1
            if resident.in_flight == 0:
                entry.idle.set()

    # ------------------------------------------------------------ control

    async def start(self) -> None:
        """Pinned models, then (``on_demand`` false) every other model, loaded now."""
        first = sorted(self.pin) + [n for n in self.known() if n not in self.pin]
        for name in first if not self.on_demand else sorted(self.pin):
            await self.load(name)

    async def load(self, name: str, config: ModelConfig | None = None) -> None:
        """Make ``name`` resident (again, with ``config``, when one is given); one load
        per model however many callers ask at once."""
        entry = self._entries[self.owner(name)]
        name = entry.config.name
        while True:
            if entry.state == LOADING and entry.loading is not None:
                await asyncio.shield(entry.loading)
                if config is None:
                    return
            elif entry.state == UNLOADING:
                await entry.unloaded.wait()
            elif entry.state == READY and config is not None:
                await self.unload(name, why="reloaded with a new configuration")
            elif entry.state == READY:
                await self._refresh(entry)
                return
            else:
                break
        entry.state, entry.reason = LOADING, ""
        if config is not None:
            entry.config = config
        # A task of its own: a caller that goes away (its client disconnected) does not
        # cancel a load that others wait for, or leave a half-loaded model behind.
        task = asyncio.ensure_future(self._load_task(entry))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        entry.loading = task
        await asyncio.shield(task)

    async def _refresh(self, entry: _Entry) -> None:
        """A resident model from object storage, asked to load again: re-check the object
        and swap a changed one in between batches (as SIGHUP does elsewhere)."""
        resident = entry.resident
        if resident is None or not is_remote(entry.config.source):
            return
        versioned = resident.served[0].runner
        assert isinstance(versioned, VersionedRunner)
        number = await asyncio.to_thread(
            refresh, versioned, entry.config, self._cache_dir, self._storage
        )
        if number is not None:
            log.info("store: %s now serving version %d", entry.config.name, number)

    async def _load_task(self, entry: _Entry) -> None:
        try:
            await self._load_one(entry)
        except BaseException as exc:
            entry.state, entry.reason = UNAVAILABLE, f"load failed: {exc}"
            self._event("load failed", entry.config.name, why=str(exc))
            raise
        finally:
            entry.loading = None

    async def unload(self, name: str, *, why: str = "unloaded on request") -> None:
        """Take ``name`` out of memory once no request holds it (requests already queued
        are answered first; new ones wait for the unload, then load it again on demand)."""
        entry = self._entries[self.owner(name)]
        if entry.state == LOADING and entry.loading is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(entry.loading)
        if entry.state == UNLOADING:
            await entry.unloaded.wait()
            return
        if entry.resident is None:
            return
        entry.state, entry.reason = UNLOADING, why
        entry.unloaded.clear()
        try:
            await entry.idle.wait()
            await self._close(entry)
            entry.counts["unloads"] += 1
            self._event("unload", entry.config.name, why=why)
        finally:
            entry.state = UNAVAILABLE
            entry.unloaded.set()

    async def close(self) -> None:
        """Unload every model (requests holding one are answered first)."""
        for name in list(self.resident()):
            await self.unload(name, why="the server stopped")

    # ------------------------------------------------------------ inside

    def _lock(self) -> asyncio.Lock:
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        return self._load_lock

    async def _load_one(self, entry: _Entry) -> None:
        name, config = entry.config.name, entry.config
        size = _file_size(config, self._cache_dir, self._storage)
        async with self._lock():
            await self._make_room(name, entry.charge or size)
            if not self._primed:  # the engine's one-time start is no model's memory
                await self._release_served(await asyncio.to_thread(self._loader, config))
                self._primed = True
            start, before = time.perf_counter(), self._measure()
            served = await asyncio.to_thread(self._loader, config)
            # RSS growth reads low when a load reuses memory freed earlier: a model is
            # charged the most any of its loads measured.
            charged = max(self._measure() - before, size, entry.charge or 0)
            batchers = {
                m.name: Batcher(m.runner, m.policy, instance_count=m.instance_count, name=m.name)
                for m in served
            }
            resident = Resident(config, served, batchers, charged, 0.0, self._clock())
            entry.charge = charged
            if self.budget and charged > self.budget:
                await self._release(resident)
                raise ModelNotReady(
                    f"model {name!r} takes {charged / MB:.1f} MB resident (measured after its "
                    f"load and warm-up), more than the whole budget of {self.budget / MB:.1f} MB"
                )
            try:
                await self._make_room(name, charged)
            except Overloaded:
                await self._release(resident)
                raise
            resident.load_s = time.perf_counter() - start
        entry.specs = {m.name: m.runner.spec for m in served}
        entry.resident, entry.state, entry.reason = resident, READY, ""
        entry.counts["loads"] += 1
        entry.counts["load_seconds"] += resident.load_s
        for served_name, batcher in batchers.items():
            self._watch(served_name, batcher)
        self._event(
            "load", name, seconds=round(resident.load_s, 4), bytes=charged,
            resident_bytes=self.resident_bytes,
        )  # fmt: skip

    async def _make_room(self, name: str, needed: int) -> None:
        """Evict least recently used idle, unpinned models until ``needed`` bytes fit."""
        if not self.budget:
            return
        if needed > self.budget:
            raise ModelNotReady(
                f"model {name!r} takes {needed / MB:.1f} MB resident, more than the whole "
                f"budget of {self.budget / MB:.1f} MB"
            )
        while self.resident_bytes + needed > self.budget:
            idle = [
                (e.resident.last_used, n)
                for n, e in self._entries.items()
                if e.resident is not None and e.state == READY and e.resident.in_flight == 0
                and n not in self.pin and n != name
            ]  # fmt: skip
            if not idle:
                held = {n: round(r.charged / MB, 1) for n, r in self.resident().items()}
                raise Overloaded(
                    f"model {name!r} needs {needed / MB:.1f} MB and the budget of "
                    f"{self.budget / MB:.1f} MB is held by models in use or pinned (MB: {held})",
                    retry_after_s=1.0,
                )
            _, victim = min(idle)
            entry = self._entries[victim]
            entry.state, entry.reason = UNLOADING, f"evicted (least recently used) for {name}"
            entry.unloaded.clear()
            try:
                await self._close(entry)
            finally:
                entry.state = UNAVAILABLE
                entry.unloaded.set()
            entry.counts["evictions"] += 1
            self._event("evict", victim, why=f"room for {name}", freed_bytes=entry.charge)

    async def _close(self, entry: _Entry) -> None:
        resident, entry.resident = entry.resident, None
        if resident is not None:
            for served_name in resident.batchers:
                self._unwatch(served_name)
            await self._release(resident)

    async def _release(self, resident: Resident) -> None:
        for batcher in resident.batchers.values():
            await batcher.aclose()
        await self._release_served(resident.served)

    @staticmethod
    async def _release_served(served: list[ServedModel]) -> None:
        def close() -> None:
            closed: set[int] = set()
            for m in served:
                if id(m.runner) not in closed:
                    closed.add(id(m.runner))
                    m.runner.close()
            release_freed()

        await asyncio.to_thread(close)

    def _event(self, kind: str, name: str, **details: Any) -> None:
        event = {"time": round(time.time(), 3), "event": kind, "model": name, **details}
        self.events.append(event)
        log.info("store: %s %s %s", kind, name, details or "")

    # ------------------------------------------------------------ reporting

    def totals(self) -> dict[str, float]:
        """Loads, unloads, evictions and load seconds over every model."""
        out = {"loads": 0.0, "unloads": 0.0, "evictions": 0.0, "load_seconds": 0.0}
        for entry in self._entries.values():
            for key in out:
                out[key] += entry.counts[key]
        return out

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index of every known model, with what it is charged."""
        out = []
        for name in self.known():
            e = self._entries[name]
            row: dict[str, Any] = {"name": name, "version": "1", "state": e.state}
            if e.reason:
                row["reason"] = e.reason
            if e.resident is not None:
                row["resident_bytes"] = e.resident.charged
                row["in_flight"] = e.resident.in_flight
            out.append(row)
        return out

    def figures(self) -> Iterable[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """Prometheus families: (name, kind, help, [(labels, value)])."""
        per_model = {
            "servekit_store_loads_total": ("counter", "Loads of the model", "loads"),
            "servekit_store_unloads_total": ("counter", "Unloads on request", "unloads"),
            "servekit_store_evictions_total": ("counter", "Evictions for room", "evictions"),
            "servekit_store_load_seconds_total": (
                "counter", "Seconds spent loading and warming up the model", "load_seconds",
            ),
        }  # fmt: skip
        entries = sorted(self._entries.items())
        for metric, (kind, help_text, key) in per_model.items():
            yield metric, kind, help_text, [({"model": n}, e.counts[key]) for n, e in entries]
        yield (
            "servekit_store_resident_bytes", "gauge",
            "Memory the model is charged while resident (0 when not)",
            [({"model": n}, float(e.resident.charged if e.resident else 0)) for n, e in entries],
        )  # fmt: skip
        yield (
            "servekit_store_budget_bytes", "gauge",
            "The store's memory budget (0: none)", [({}, float(self.budget))],
        )  # fmt: skip


def _file_size(config: ModelConfig, cache_dir: str | None, storage: StorageConfig | None) -> int:
    """The model's file size: the first estimate of what it will take resident."""
    from .. import zoo

    try:
        return os.path.getsize(zoo.resolve(config.source, cache_dir, storage))
    except (OSError, ModelNotFound, FetchFailed):
        return 0
