"""One unit of a ``ModelStore``'s residency (a version of a model) and what loads and
releases it: ``Unit`` (its state, charge, leases and counts), ``Resident`` (its runners and
Batchers while loaded)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..batching import Batcher
from ..config import ModelConfig, image_model_name, version_model_name
from ..errors import FetchFailed, ModelNotFound
from ..runners.base import warm_up
from ..runtime.base import ServedModel, load_models
from ..spec import ModelSpec
from ..storage import StorageConfig
from .memory import release_freed

__all__ = [
    "COUNTS", "LOADING", "MB", "READY", "UNAVAILABLE", "UNLOADING", "Dropped", "Resident",
    "Unit", "Units", "file_size", "load_served", "release_served", "resolved", "unit_config",
]  # fmt: skip

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
SAMPLES_KEPT = 3
MB = 1024 * 1024
COUNTS = ("loads", "unloads", "evictions", "load_seconds", "refusals", "dropped")


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


class Dropped(Exception):
    """A load on demand that no request waits for any more."""


@dataclass
class Unit:
    """One unit of residency: a version of a model (its own file, load and charge)."""

    config: ModelConfig
    model: str
    """The model it is a version of (what clients name)."""
    number: int
    """Its version number."""
    key: str
    """The unit's name: the model's own for its version, ``version_model_name`` else."""
    state: str = UNAVAILABLE
    reason: str = "not loaded yet"
    resident: Resident | None = None
    loading: asyncio.Future[None] | None = None
    requested: bool = False
    """The load under way was asked for (start, the repository API): never dropped."""
    wanted: int = 0
    """Requests holding the model or waiting for it: while any do, it is never evicted."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no request holds the model (what an unload waits for)."""
    unloaded: asyncio.Event = field(default_factory=asyncio.Event)
    """Set unless an unload is under way."""
    charge: int | None = None
    """What it is charged: the meter's figure, else the median of its last loads."""
    metered: bool = False
    """Whether ``charge`` is the meter's (measured alone) rather than measured in place."""
    samples: collections.deque[int] = field(
        default_factory=lambda: collections.deque(maxlen=SAMPLES_KEPT)
    )
    specs: dict[str, ModelSpec] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0.0))

    @property
    def waiting(self) -> int:
        """Requests waiting for it to be loaded (wanting it, not holding it yet)."""
        return self.wanted - (self.resident.in_flight if self.resident else 0)


def unit_config(config: ModelConfig, number: int) -> ModelConfig:
    """One version as a unit loads it: its own file, no rollout; the image model (encoded
    images in) is served over the model's own version only."""
    unit = config.for_version(number)
    return unit if number == config.version else dataclasses.replace(unit, image=False)


class Units:
    """A store's models (name -> config) and the ``Unit`` of each of their versions:
    which unit serves a name (a model, its image model) at a version."""

    def __init__(self, models: Mapping[str, ModelConfig]) -> None:
        self.models = dict(models)
        self.by_key: dict[str, Unit] = {}
        """Unit key (the model's name, ``version_model_name`` for another version) -> Unit."""
        self._keys: dict[tuple[str, int], str] = {}
        for name, config in models.items():
            for number in config.version_numbers:
                key = name if number == config.version else version_model_name(name, number)
                if key in self.by_key or (key != name and key in models):
                    raise ValueError(f"[store] two models served as {key!r}")
                unit = Unit(unit_config(config, number), name, number, key)
                unit.idle.set()
                unit.unloaded.set()
                self.by_key[key] = unit
                self._keys[name, number] = key
        self._owner = {name: name for name in models}
        for name, config in models.items():
            if config.image:
                self._owner.setdefault(image_model_name(name), name)

    def owner(self, served: str) -> str:
        """The model that serves ``served`` (itself, or the model of ``<m>_image``)."""
        name = self._owner.get(served)
        if name is None:
            raise ModelNotFound(f"unknown model {served!r}; the store knows {len(self.by_key)}")
        return name

    def get(self, served: str, version: int | None = None) -> Unit:
        """The unit serving ``served`` at ``version`` (its model's own by default)."""
        model = self.owner(served)
        number = self.models[model].version if version is None else version
        key = self._keys.get((model, number))
        if key is None:
            raise ModelNotFound(
                f"model {model!r} has no version {number}; it has "
                f"{list(self.models[model].version_numbers)}"
            )
        return self.by_key[key]

    def of(self, model: str) -> list[Unit]:
        """Every version's unit, the model's own first."""
        return [self.by_key[self._keys[model, n]] for n in self.models[model].version_numbers]

    def reconfigure(self, model: str, config: ModelConfig) -> None:
        """Load ``model`` with ``config`` from now on (its versions stay)."""
        if config.version_numbers != self.models[model].version_numbers:
            raise ValueError(f"model {model!r}: a load cannot change its versions")
        self.models[model] = config


def load_served(
    config: ModelConfig, cache_dir: str | None, storage: StorageConfig | None
) -> list[ServedModel]:
    served = load_models(config, cache_dir, storage)
    for m in served:
        warm_up(m.runner, m.name)
    release_freed()  # the load's scratch: what stays resident is the model's own
    return served


async def release_served(served: list[ServedModel]) -> None:
    """Close each runner once (a model and its image model share one), off the loop."""

    def close() -> None:
        closed: set[int] = set()
        for m in served:
            if id(m.runner) not in closed:
                closed.add(id(m.runner))
                m.runner.close()
        release_freed()

    await asyncio.to_thread(close)


def resolved(
    config: ModelConfig, cache_dir: str | None, storage: StorageConfig | None
) -> str | None:
    """The model's file (fetched first where it is remote); None where it has none."""
    from .. import zoo

    try:
        return os.fspath(zoo.resolve(config.source, cache_dir, storage))
    except (OSError, ModelNotFound, FetchFailed):
        return None


def file_size(path: str | None) -> int:
    """The model's file size: what it takes at least, and the first estimate of its charge."""
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0
