"""``ServedModels``: the one record of what an in-process runtime serves, by model name.

Per model it holds every version served (``ServedModel``, a ``VersionedRunner`` each), the
model's ``Traffic`` (split, shadow, canary), and while serving the version's ``Batcher``;
each version's served name is ``version_model_name``'s. Native and PyTriton keep nothing
of their own beside it; the ``[store]`` keeps residency, over the same ``Traffic``
(``servekit.store.StoreModels``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..batching import Batcher
from ..batching.sequencer import SequenceBatcher
from ..cache import LocalStore, RedisStore, ResponseCache
from ..config import ModelConfig, ServeConfig, ServerConfig, version_model_name
from ..errors import ModelNotFound
from ..protocol.cached import CachedModel, file_identity
from ..protocol.models import BatchedModel, DecoupledModel
from ..protocol.routed import route, traffic_of
from ..rollout import Traffic
from ..runners.base import warm_up
from ..runners.versioned import VersionedRunner
from .base import ServedModel, load_or_unready, reload_models

__all__ = [
    "ServedModels",
    "behind_cache",
    "model_identity",
    "response_cache",
    "scheduled",
    "served_name",
    "watched_identity",
]


def served_name(model: ServedModel) -> str:
    """The name a version is served under on its own (``version_model_name``)."""
    return model.name if model.version == 1 else version_model_name(model.name, model.version)


def scheduled(m: ServedModel) -> Batcher | SequenceBatcher | DecoupledModel:
    """One loaded version behind its scheduler: Triton's sequence batcher for a model with
    ``sequence_batching``, a ``DecoupledModel`` for a decoupled one, else the dynamic
    batcher; each with the model's policy and instances (every in-process runtime)."""
    if getattr(m.runner, "decoupled", False):
        return DecoupledModel(m.runner, m.instance_count, m.name)
    if m.sequence is not None:
        return SequenceBatcher(
            m.runner, m.policy, m.sequence, instance_count=m.instance_count, name=m.name
        )
    return Batcher(m.runner, m.policy, instance_count=m.instance_count, name=m.name)


class ServedModels:
    """Every model of one runtime: its versions, its traffic and, while serving, its
    Batchers. Loaded once (``load``); a restart keeps the warm runners and the traffic.

    Args:
        config: what ``load`` and ``reload`` read (the models' files, their splits).
        models: models built by app code instead (each wrapped in a ``VersionedRunner``
            so that it can be updated in place).
    """

    def __init__(self, config: ServeConfig | None = None, models: Sequence[ServedModel] = ()):
        names = [served_name(m) for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        self.config = config
        self._models = [
            m
            if isinstance(m.runner, VersionedRunner)
            else dataclasses.replace(m, runner=VersionedRunner(m.runner, name=m.name))
            for m in models
        ]
        self.traffic: dict[str, Traffic] = (
            traffic_of(config.models) if config and not config.store.active else {}
        )  # a store keeps its models' own
        """Each versioned model's split, shadow and canary, kept across restarts."""
        self.batchers: dict[str, Batcher | SequenceBatcher] = {}
        """Served name -> its Batcher, while ``batch`` has them running."""
        self._decoupled: list[DecoupledModel] = []
        self.cached: dict[str, CachedModel] = {}
        """Each model served behind the response cache, while ``batch`` has them running."""

    def load(self) -> list[ServedModel]:
        """Load every configured model (the first time only) and warm it up."""
        if not self._models:
            assert self.config is not None, "nothing to load: no config and no models"
            c = self.config
            self._models = [
                m for model in c.models for m in load_or_unready(model, c.cache_dir, c.storage)
            ]
        for m in self._models:
            warm_up(m.runner, m.name)
        return self._models

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def runner(self, name: str, version: int = 1) -> VersionedRunner:
        """The runner serving ``name`` at ``version``."""
        for m in self._models:
            if m.name == name and m.version == version:
                return m.runner  # type: ignore[return-value]
        raise ModelNotFound(f"no model named {name!r} version {version}; serving {self.names()}")

    def names(self) -> list[str]:
        return [served_name(m) for m in self._models]

    def routes(self, served: Collection[str] = ()) -> dict[str, dict[int, str]]:
        """Name -> version -> served name, for each model with a ``Traffic`` (the front
        routes these) but those ``served`` in process (``batch(only=)`` routes them)."""
        routes: dict[str, dict[int, str]] = {}
        for m in self._models:
            if m.name in self.traffic and m.name not in served:
                routes.setdefault(m.name, {})[m.version] = served_name(m)
        return routes

    def batch(
        self, cache: ResponseCache | None = None, *, only: Collection[str] | None = None
    ) -> dict[str, Any]:
        """Start a ``Batcher`` per version (its policy, its instances; a ``SequenceBatcher``
        for a model with ``sequence_batching``, a ``DecoupledModel`` for a decoupled one)
        and return what a front serves: one ``RoutedModel`` per model with a ``Traffic``,
        else its Batcher, behind ``cache`` where the model has ``response_cache``.
        ``only``: the models (by name) to start, where another server serves the rest."""
        served = self._batch(only)
        self.cached = {}
        for model in self.config.models if self.config and cache else ():
            if not model.response_cache or model.name not in served:
                continue
            assert cache is not None and self.config is not None
            tag = f"#{self.runner(model.name).version}"
            self.cached[model.name] = behind_cache(
                served[model.name], model, self.config, cache, tag
            )
            served[model.name] = self.cached[model.name]
        return served

    def _batch(self, only: Collection[str] | None = None) -> dict[str, Any]:
        self.close_batchers()
        by_name: dict[str, dict[int, Any]] = {}
        for m in self._models:
            if only is not None and m.name not in only:
                continue
            served = scheduled(m)
            if isinstance(served, DecoupledModel):
                self._decoupled.append(served)
            else:
                self.batchers[served_name(m)] = served
            by_name.setdefault(m.name, {})[m.version] = served
        return route(by_name, self.traffic)

    def close_batchers(self) -> None:
        for batcher in self.batchers.values():
            batcher.close()
        self.batchers = {}
        for model in self._decoupled:
            model.close()
        self._decoupled = []

    def reload(self) -> list[str]:
        """Read each configured model's file again and swap it in (``reload_models``); a
        cached model's identity follows its file, so its old answers are not found again."""
        if self.config is None:
            raise ValueError("reload needs models loaded from a ServeConfig")
        done = reload_models(self.config, self._models)
        for model in self.config.models:
            if model.name in self.cached:
                tag = f"#{self.runner(model.name).version}"
                self.cached[model.name].identity = model_identity(model, self.config, tag)
        return done

    def close(self) -> None:
        """Stop the Batchers and close each runner once; the next ``load`` loads again."""
        self.close_batchers()
        closed: set[int] = set()
        for m in self._models:
            if id(m.runner) not in closed:
                closed.add(id(m.runner))
                m.runner.close()
        self._models = []


def response_cache(config: ServeConfig | ServerConfig) -> ResponseCache | None:
    """The ``[server.cache]`` a config asks for (None: no cache)."""
    c = (config.server if isinstance(config, ServeConfig) else config).cache
    if not c.active:
        return None
    store = RedisStore(c.redis_url) if c.redis_url else LocalStore(int(c.local_size_mb * 2**20))
    return ResponseCache(store)


def behind_cache(
    found: Any, model: ModelConfig, config: ServeConfig, cache: ResponseCache, tag: str = ""
) -> CachedModel:
    """What a front serves for ``model`` (its Batcher, or a front model) behind ``cache``,
    keyed by ``model_identity``; a decoupled model is refused by name (native and Ray
    alike)."""
    if isinstance(found, DecoupledModel):
        raise ValueError(
            f"models.{model.name}: response_cache on a decoupled model (its answers are a "
            "stream, not one response)"
        )
    front = BatchedModel(found) if isinstance(found, Batcher) else found
    return CachedModel(front, cache, model.name, model_identity(model, config, tag))


def watched_identity(model: ModelConfig, config: ServeConfig) -> Callable[[], str]:
    """``model_identity``, read again only when the served file's size or modification time
    changed (cheap enough to ask per request): a reload of a changed file is a new one."""
    from .. import zoo
    from ..errors import ServekitError

    try:
        path: Path | None = zoo.resolve(model.source, config.cache_dir, config.storage)
    except (ServekitError, OSError):
        path = None
    known: dict[object, str] = {}

    def identity() -> str:
        try:
            st = path.stat() if path is not None else None
            stamp: object = (st.st_size, st.st_mtime_ns) if st is not None else None
        except OSError:
            stamp = None
        if stamp not in known:
            known.clear()
            known[stamp] = model_identity(model, config)
        return known[stamp]

    return identity


def model_identity(model: ModelConfig, config: ServeConfig, tag: str = "") -> str:
    """What the cache keys ``model``'s answers by: its served file's digest
    (``file_identity``), or its source and ``tag`` (your own Python model has no file)."""
    from .. import zoo
    from ..errors import ServekitError

    try:
        path = zoo.resolve(model.source, config.cache_dir, config.storage)
    except (ServekitError, OSError):
        path = None
    return file_identity(path, f"{model.source}{tag}")
