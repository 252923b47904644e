"""The model store as servekit's front sees it: a ``ModelRegistry`` whose models load on
demand, and Triton's repository extension (``RepositoryControl``) answered from it."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from ..batching import Batcher
from ..batching.policy import BatchingPolicy
from ..errors import InvalidInput, ModelNotFound, ModelNotReady, ServekitError
from ..protocol.models import FrontModel
from ..protocol.routed import SERVING_SINCE, RoutedModel
from ..rollout import Traffic
from ..spec import ModelSpec
from .store import READY, ModelStore

__all__ = ["StoreModels", "StoredModel"]


class StoredModel:
    """One served model of the store at one version: each request holds it
    (``ModelStore.lease``) from admission to answer, loading it first where it is not
    resident."""

    versioned = False

    def __init__(self, store: ModelStore, name: str, spec: ModelSpec, version: int) -> None:
        self.store, self.name, self.spec, self.version = store, name, spec, version
        self.versions: tuple[str, ...] = (str(version),)

    @property
    def batcher(self) -> Batcher | None:
        """The resident version's Batcher (its configuration and counters); None while it
        is not loaded."""
        resident = self.store.resident().get(self.store.unit(self.name, self.version))
        return resident.batchers.get(self.name) if resident is not None else None

    async def infer(
        self,
        inputs: Mapping[str, np.ndarray],
        *,
        priority: int = 0,
        timeout_us: int | None = None,
        version: str = "",
    ) -> dict[str, np.ndarray]:
        with failed_load(self.name):
            async with self.store.lease(self.name, self.version) as batcher:
                SERVING_SINCE.set(time.perf_counter())  # the wait for memory was no serving
                return await batcher.infer(inputs, priority=priority, timeout_us=timeout_us)


@contextlib.contextmanager
def failed_load(name: str, error: type[ServekitError] = ModelNotReady) -> Iterator[None]:
    """A model file that does not load is the model's state, not the server's fault: an
    ``error`` naming the model and why, instead of an internal error. A request for the
    model gets a ``ModelNotReady`` (503); a load asked for by name an ``InvalidInput``
    (400), as tritonserver answers a repository load that fails."""
    try:
        yield
    except ServekitError:
        raise
    except (ValueError, OSError) as exc:
        raise error(f"model {name!r} cannot be loaded: {exc}") from exc


class StoreModels:
    """``ModelRegistry`` and ``RepositoryControl`` over a ``ModelStore``. A model served in
    several versions is a ``RoutedModel`` over its stored versions, each loaded, charged and
    evicted on its own; its ``Traffic`` (split, shadow, canary) lives here, so it outlasts
    every eviction."""

    def __init__(self, store: ModelStore, traffic: Mapping[str, Traffic] | None = None) -> None:
        self.store, self.traffic = store, dict(traffic or {})
        self._routed: dict[str, RoutedModel] = {}

    async def lookup(self, name: str) -> FrontModel:
        with failed_load(name):
            spec = await self.store.spec(name)
        model = self.store.owner(name)
        if name != model or model not in self.traffic:
            return StoredModel(self.store, name, spec, self.store.config(model).version)
        routed = self._routed.get(model)
        if routed is None:
            versions = {v: StoredModel(self.store, name, spec, v) for v in self.store.numbers(name)}
            routed = self._routed[model] = RoutedModel(versions, self.traffic[model])
        return routed

    async def is_ready(self, name: str, version: str | None) -> bool:
        try:
            return self.store.state(name, int(version) if version else None) == READY
        except (ModelNotFound, ValueError):
            return False

    def loaded(self) -> Mapping[str, FrontModel]:
        """The resident models' own versions (for metrics and statistics)."""
        out: dict[str, FrontModel] = {}
        for resident in self.store.resident().values():
            for served, batcher in resident.batchers.items():
                own = self.store.config(served).version
                if self.store.state(served, own) == READY:
                    out[served] = StoredModel(self.store, served, batcher.spec, own)
        return out

    def index(self) -> list[dict[str, Any]]:
        return self.store.index()

    async def load(self, name: str, config: Mapping[str, Any] | None = None) -> None:
        owner = self.store.owner(name)
        base = self.store.config(owner)
        with failed_load(owner, InvalidInput):
            changed = overridden(base, config, await self.store.spec(owner)) if config else None
            await self.store.load(owner, changed)

    async def unload(self, name: str) -> None:
        await self.store.unload(self.store.owner(name))


APPLIED = ("max_batch_size", "dynamic_batching", "instance_group")
"""The fields of Triton's model configuration a load's override applies."""
AS_SERVED = ("name", "backend", "input", "output")
"""Fields taken when they say what is served already (a configuration read back with
``get_model_config`` and changed loads as it is); refused when they differ."""


def overridden(model: Any, config: Mapping[str, Any], spec: ModelSpec) -> Any:
    """``model`` (a ``ModelConfig``) with what Triton's model configuration JSON ``config``
    sets of its batching (``max_batch_size``, ``dynamic_batching``) and instances
    (``instance_group`` counts on CPU). Every other field is refused by name, unless it
    says what is served already (``spec``: the model's signature)."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    from ..protocol.pbtxt import model_config

    where = "repository load: parameters.config"
    unknown = sorted(set(config) - set(APPLIED) - set(AS_SERVED))
    if unknown:
        raise InvalidInput(
            f"{where}: servekit does not apply {unknown} to a stored model (it applies "
            f"{list(APPLIED)}; {list(AS_SERVED)} only as they are served)"
        )
    try:
        message = json_format.ParseDict(config, model_config_pb2.ModelConfig())
    except json_format.ParseError as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    served = model_config(model.name, spec, backend="servekit")
    for key in AS_SERVED:
        if key in config and getattr(message, key) != getattr(served, key):
            has = json_format.MessageToDict(served, preserving_proto_field_name=True).get(key)
            raise InvalidInput(
                f"{where}: {key!r} cannot change on a load: the model has {has!r}, "
                f"the config says {config[key]!r}"
            )
    for group in message.instance_group:
        extra = [f.name for f, _ in group.ListFields() if f.name not in ("name", "count", "kind")]
        if extra or group.kind not in (
            model_config_pb2.ModelInstanceGroup.KIND_AUTO,
            model_config_pb2.ModelInstanceGroup.KIND_CPU,
        ):
            raise InvalidInput(
                f"{where}: instance_group: servekit applies a count of CPU instances here, "
                f"not {extra or model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)}"
            )
    changes: dict[str, Any] = {}
    if "max_batch_size" in config or "dynamic_batching" in config:
        changes["batching"] = BatchingPolicy.from_triton(message)
    if "instance_group" in config:
        changes["instances"] = max(1, sum(g.count or 1 for g in message.instance_group))
    try:
        return dataclasses.replace(model, **changes)
    except ValueError as exc:
        raise InvalidInput(f"{where}: {exc}") from None
