"""``ModelStore``: which models are resident, loading one on demand, and the memory budget.

Every model of the catalog is known; a resident one has its runners and a Batcher per
served name (a model and its image model). A request holds its model (``lease``) from the
moment it asks for it to its answer, waiting for a load and queued time included, so a
model that requests wait for or use is never evicted or unloaded under them: an unload
waits for them, an eviction picks only models nobody holds, and a model loaded for its
waiters stays until they have run (without that, under more clients than the budget holds
models, each load evicted the one before it for ever). Loads run one at a time and at most
``max_loads_per_s``; each is charged what the model costs alone (``Meter``: measured once
in a quiet helper process, so other requests' memory never counts), and room is made for
that charge before the load. When the budget is held by models in use, a load waits for
one to come free; a request waits at most ``wait_s`` for its model, then gets a 503
naming what holds the budget. A load that no request waits for any more by its turn is
dropped. Concurrent requests for a model that is loading wait on that one load.

Everything here runs on the serving event loop; loads, warm-ups and closes run on
worker threads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import statistics
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from ..batching import Batcher
from ..config import ModelConfig, image_model_name
from ..errors import ModelNotFound, ModelNotReady, Overloaded
from ..runners.versioned import VersionedRunner, check_compatible
from ..runtime.base import ServedModel, probe_model, refresh
from ..spec import ModelSpec
from ..storage import StorageConfig, is_remote
from . import report
from .memory import resident_bytes
from .meter import Meter
from .room import Room
from .unit import (
    LOADING,
    MB,
    READY,
    UNAVAILABLE,
    UNLOADING,
    Dropped,
    Resident,
    Unit,
    Units,
    file_size,
    load_served,
    release_served,
    resolved,
    unit_config,
)

__all__ = ["ModelStore", "Resident"]

log = logging.getLogger(__name__)

EVENTS_KEPT = 100


class ModelStore(Room):
    """The models of ``models`` (name -> config), resident within ``budget_bytes`` (0: no
    budget); ``pin``ned ones are never evicted. ``on_demand``: a request for a model not
    loaded loads it (else only ``load`` does). A request waits at most ``wait_s`` for its
    model (loads queued before it, room in the budget). ``meter`` gives each model's
    charge before its load; without one, each load's growth of ``measure`` is measured in
    place (the median of its last three loads). ``watch``/``unwatch`` are told of each
    Batcher as it comes and goes (the front's metrics)."""

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        *,
        budget_bytes: int = 0,
        pin: Iterable[str] = (),
        on_demand: bool = True,
        wait_s: float = 5.0,
        max_loads_per_s: float = 0.0,
        cache_dir: str | None = None,
        storage: StorageConfig | None = None,
        loader: Callable[[ModelConfig], list[ServedModel]] | None = None,
        meter: Meter | None = None,
        watch: Callable[[str, str, Batcher], None] = lambda name, version, batcher: None,
        unwatch: Callable[[str, str], None] = lambda name, version: None,
        clock: Callable[[], float] = time.monotonic,
        measure: Callable[[], int] = resident_bytes,
        prime: bool = True,
    ) -> None:
        self.budget, self.pin, self.on_demand = budget_bytes, frozenset(pin), on_demand
        self.wait_s, self.max_loads_per_s = wait_s, max_loads_per_s
        self._cache_dir, self._storage, self._meter = cache_dir, storage, meter
        self._loader = loader or (lambda config: load_served(config, cache_dir, storage))
        self._watch, self._unwatch, self._clock, self._measure = watch, unwatch, clock, measure
        self.units = Units(models)
        self._entries = self.units.by_key
        self._load_lock: asyncio.Lock | None = None
        self._room: asyncio.Event | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        self._closing = False
        self._last_load = float("-inf")
        self._primed = not prime
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)

    # ------------------------------------------------------------ what is known

    def owner(self, served: str) -> str:
        """The store's model that serves ``served`` (itself, or the model of ``<m>_image``)."""
        return self.units.owner(served)

    def known(self) -> list[str]:
        return sorted(self.units.models)

    def config(self, name: str) -> ModelConfig:
        """The configuration ``name`` is (or will be) loaded with, every version included."""
        return self.units.models[self.owner(name)]

    def numbers(self, name: str) -> tuple[int, ...]:
        """The versions of ``name``'s model, its own first."""
        return self.config(name).version_numbers

    def state(self, name: str, version: int | None = None) -> str:
        """``READY``, ``LOADING``, ``UNLOADING`` or ``UNAVAILABLE``: the model's own version,
        or ``version``."""
        return self.units.get(name, version).state

    def unit(self, served: str, version: int | None = None) -> str:
        """The unit serving ``served`` at ``version`` (its model's own by default): the key
        of ``resident()``."""
        return self.units.get(served, version).key

    def resident(self) -> dict[str, Resident]:
        return {n: e.resident for n, e in self._entries.items() if e.resident is not None}

    @property
    def resident_bytes(self) -> int:
        return sum(r.charged for r in self.resident().values())

    async def spec(self, served: str) -> ModelSpec:
        """``served``'s signature (every version has it): from its last load, else read
        from its file once."""
        entry = self.units.get(served)
        if served not in entry.specs:
            # One engine session at a time: a probe builds one, as a load does, and
            # their peaks (about three times the model's settled size) must not add up.
            async with self._lock():
                try:
                    await self._probe(entry)
                except Exception as exc:  # the index says why, as for a failed load
                    entry.reason = f"load failed: {exc or type(exc).__name__}"
                    raise
            if served not in entry.specs:
                raise ModelNotFound(
                    f"unknown model {served!r}: {entry.config.name} is no image classifier"
                )
        return entry.specs[served]

    async def _probe(self, entry: Unit) -> None:
        """Read the unit's signatures from its file (the caller holds the load lock)."""
        if entry.config.name in entry.specs:
            return
        probe = await asyncio.to_thread(probe_model, entry.config, self._cache_dir, self._storage)
        entry.specs.setdefault(entry.config.name, probe.spec)
        if probe.image_spec is not None:
            entry.specs.setdefault(image_model_name(entry.config.name), probe.image_spec)

    # ------------------------------------------------------------ requests

    @contextlib.asynccontextmanager
    async def lease(self, served: str, version: int | None = None) -> AsyncIterator[Batcher]:
        """``served``'s Batcher (of its model's own version, or ``version``), held (never
        evicted or unloaded) from now until the block ends; loads it first where it is not
        resident and ``on_demand`` allows, waiting at most ``wait_s`` (then ``Overloaded``,
        naming what holds the budget)."""
        entry = self.units.get(served, version)
        name = entry.key
        entry.wanted += 1
        resident: Resident | None = None
        try:
            resident = await self._admit(entry)
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
        finally:
            entry.wanted -= 1
            if entry.wanted == 0:
                self._freed()

    async def _admit(self, entry: Unit) -> Resident:
        """The entry's resident model, once it is one: at most ``wait_s`` from now."""
        name = entry.key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while entry.state != READY or entry.resident is None:
            if self._closing:
                raise ModelNotReady(f"model {name!r} is not served: the server is stopping")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._refusal(entry)
            try:
                if entry.state == LOADING and entry.loading is not None:
                    await asyncio.wait_for(asyncio.shield(entry.loading), remaining)
                elif entry.state == UNLOADING:
                    await asyncio.wait_for(entry.unloaded.wait(), remaining)
                elif self.on_demand:
                    self._start_load(entry)
                else:
                    raise ModelNotReady(
                        f"model {name!r} is not loaded ({entry.reason}); load it with "
                        f"POST /v2/repository/models/{name}/load"
                    )
            except TimeoutError:
                raise self._refusal(entry) from None
        return entry.resident

    def _refusal(self, entry: Unit) -> Overloaded:
        entry.counts["refusals"] += 1
        held = {n: round(r.charged / MB, 1) for n, r in sorted(self.resident().items())}
        queued = sum(1 for e in self._entries.values() if e.state == LOADING)
        why = (
            f"model {entry.key!r} was not loaded within {self.wait_s:g} s: {queued} load(s) queued"
        )
        if self.budget:
            why += (
                f"; the budget of {self.budget / MB:.1f} MB is held by models in use or pinned "
                f"(MB: {held})"
            )
        return Overloaded(why, retry_after_s=1.0)

    # ------------------------------------------------------------ control

    async def start(self) -> None:
        """Pinned models, then (``on_demand`` false) every other model, loaded now (each
        of its versions)."""
        first = sorted(self.pin) + [n for n in self.known() if n not in self.pin]
        for name in first if not self.on_demand else sorted(self.pin):
            await self.load(name)

    def _units_of(self, model: str) -> list[Unit]:
        return self.units.of(model)

    async def load(self, name: str, config: ModelConfig | None = None) -> None:
        """Make every version of ``name`` resident (again, with ``config``, when one is
        given); one load per version however many callers ask at once."""
        model = self.owner(name)
        if config is not None:
            self.units.reconfigure(model, config)
        for entry in self._units_of(model):
            unit = None if config is None else unit_config(config, entry.number)
            await self._load_unit(entry, unit)

    async def _load_unit(self, entry: Unit, config: ModelConfig | None) -> None:
        name = entry.key
        while True:
            if entry.state == LOADING and entry.loading is not None:
                entry.requested = True
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
        await asyncio.shield(self._start_load(entry, config, requested=True))

    def _start_load(
        self, entry: Unit, config: ModelConfig | None = None, *, requested: bool = False
    ) -> asyncio.Future[None]:
        entry.state, entry.reason, entry.requested = LOADING, "", requested
        if config is not None:  # another configuration costs what it costs: measured anew
            entry.config, entry.charge, entry.metered = config, None, False
            entry.samples.clear()
        # A task of its own: a caller that goes away (its client disconnected) does not
        # cancel a load that others wait for, or leave a half-loaded model behind.
        task = asyncio.ensure_future(self._load_task(entry))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        task.add_done_callback(self._tasks.discard)
        self._tasks.add(task)
        entry.loading = task
        return task

    async def _refresh(self, entry: Unit) -> None:
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
            log.info("store: %s now serves its object's update %d", entry.key, number)

    async def _load_task(self, entry: Unit) -> None:
        try:
            await self._load_one(entry)
        except Dropped:
            entry.state, entry.reason = UNAVAILABLE, "load dropped: no request waited for it"
            entry.counts["dropped"] += 1
            self._event("load dropped", entry, why="no request waited for it")
        except BaseException as exc:
            why = f"{exc}" or type(exc).__name__
            entry.state, entry.reason = UNAVAILABLE, f"load failed: {why}"
            self._event("load failed", entry, why=why)
            raise
        finally:
            entry.loading = None
            self._freed()

    async def unload(self, name: str, *, why: str = "unloaded on request") -> None:
        """Take every version of ``name`` out of memory once no request holds it (requests
        already queued are answered first; new ones wait for the unload, then load it
        again on demand)."""
        for entry in self._units_of(self.owner(name)):
            await self._unload_unit(entry, why)

    async def _unload_unit(self, entry: Unit, why: str) -> None:
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
            self._event("unload", entry, why=why)
        finally:
            entry.state = UNAVAILABLE
            entry.unloaded.set()
            self._freed()

    async def close(self) -> None:
        """Refuse new requests, let the load under way finish and drop the queued ones,
        then unload every model (requests holding one are answered first) and stop the
        meter: no task of the store outlives this."""
        self._closing = True
        self._freed()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for key in list(self.resident()):
            await self._unload_unit(self._entries[key], "the server stopped")
        if self._meter is not None:
            await asyncio.to_thread(self._meter.close)

    # ------------------------------------------------------------ loading

    async def _load_one(self, entry: Unit) -> None:
        name, config = entry.key, entry.config
        async with self._lock():
            self._still_wanted(entry)
            await self._pace()
            path = await asyncio.to_thread(resolved, config, self._cache_dir, self._storage)
            size = file_size(path)
            if self._meter is not None and not entry.metered:
                figure = await asyncio.to_thread(self._meter.charge, config, path)
                if figure is not None:
                    entry.charge, entry.metered = max(figure, size), True
            expected = entry.charge or size
            self._fits(name, expected)
            await self._make_room(entry, expected)
            self._still_wanted(entry)
            if not self._primed:  # the engine's one-time start is no model's memory
                await release_served(await asyncio.to_thread(self._loader, config))
                self._primed = True
            start, before = time.perf_counter(), self._measure()
            served = await asyncio.to_thread(self._loader, config)
            if not entry.metered:
                # No figure from the meter: this load's own growth, at least the file;
                # the median of the last loads, so one noisy reading neither sticks nor
                # ratchets the charge up.
                entry.samples.append(max(self._measure() - before, size))
                entry.charge = int(statistics.median(entry.samples))
            charged = entry.charge or size
            try:
                await self._same_signature(entry, served)
            except BaseException:
                await release_served(served)
                raise
            batchers = {
                m.name: Batcher(m.runner, m.policy, instance_count=m.instance_count, name=m.name)
                for m in served
            }
            resident = Resident(config, served, batchers, charged, 0.0, self._clock())
            try:
                self._fits(name, charged)
                await self._make_room(entry, charged)
            except (ModelNotReady, Overloaded, Dropped):
                await self._release(resident)
                raise
            resident.load_s = time.perf_counter() - start
        entry.specs = {m.name: m.runner.spec for m in served}
        entry.resident, entry.state, entry.reason = resident, READY, ""
        entry.counts["loads"] += 1
        entry.counts["load_seconds"] += resident.load_s
        for served_name, batcher in batchers.items():
            self._watch(served_name, str(entry.number), batcher)
        self._event(
            "load", entry, seconds=round(resident.load_s, 4), bytes=charged,
            resident_bytes=self.resident_bytes,
        )  # fmt: skip

    async def _same_signature(self, entry: Unit, served: list[ServedModel]) -> None:
        """A version beside the model's own serves its signature, or is refused naming the
        difference (``UpdateRefused``), as everywhere versions are served."""
        if entry.number == self.units.models[entry.model].version:
            return
        own = self.units.get(entry.model)
        await self._probe(own)
        check_compatible(
            own.specs[entry.model], served[0].runner.spec, f"{entry.model} version {entry.number}"
        )

    # ------------------------------------------------------------ reporting

    def totals(self) -> dict[str, float]:
        """Loads, unloads, evictions, load seconds, refusals and dropped loads, summed."""
        return report.totals(self._entries.values())

    def index(self) -> list[dict[str, Any]]:
        """Triton's repository index of every known model, with what it is charged."""
        return report.index(self._entries.values())

    def figures(self) -> Iterable[report.Family]:
        """Prometheus families: (name, kind, help, [(labels, value)])."""
        return report.figures(self._entries.values(), self.budget)
