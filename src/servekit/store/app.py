"""A ``[store]`` served: its ``ModelStore`` and the ``KServeApp`` over it, the same on every
runtime that honours it (native; Ray, in its ingress replica)."""

from __future__ import annotations

from collections.abc import Callable

from ..config import ServeConfig
from ..http.app import KServeApp
from ..metrics import Metrics
from ..protocol.routed import traffic_of
from ..protocol.shm import SharedMemory
from ..tracing import Tracing
from .catalog import catalog
from .meter import Meter
from .registry import StoreModels
from .store import ModelStore

__all__ = ["store_app"]


def store_app(
    config: ServeConfig,
    *,
    ready: Callable[[], bool] | None = None,
    shared_memory: SharedMemory | None = None,
    tracing: Tracing | None = None,
) -> tuple[KServeApp, ModelStore]:
    """The app serving ``config``'s store (Triton's repository extension included), its
    Batchers' and the store's series on ``/metrics``; start the store on the app's loop."""
    metrics = Metrics()
    models = catalog(config)
    metrics.autoscale.update({name: m.autoscale for name, m in models.items()})
    store = ModelStore(
        models,
        budget_bytes=config.store.budget_bytes,
        pin=config.store.pin,
        on_demand=config.store.load == "on_demand",
        wait_s=config.store.wait_s,
        max_loads_per_s=config.store.max_loads_per_s,
        cache_dir=config.cache_dir,
        storage=config.storage,
        meter=Meter(config.cache_dir, config.storage) if config.store.meter else None,
        watch=lambda name, version, batcher: metrics.watch(batcher, name, version),
        unwatch=metrics.unwatch,
    )
    metrics.collect(store.figures)
    traffic = traffic_of(models.values())
    for t in traffic.values():
        metrics.watch_traffic(t)
    app = KServeApp(
        StoreModels(store, traffic),
        max_body_bytes=config.server.max_body_bytes,
        ready=ready,
        metrics=metrics,
        inference_token=config.server.inference_token,
        control_token=config.server.control_token,
        shared_memory=shared_memory,
        tracing=tracing,
    )
    return app, store
