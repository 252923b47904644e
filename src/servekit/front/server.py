"""The front's server: servekit's HTTP/1.1 server (``http.h1``) on the public HTTP port
and, on the same loop, servekit's gRPC server on the public gRPC port (``relay``), both
over one registry of the models tritonserver serves (``front``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..cache import ResponseCache
from ..config import MAX_BODY_BYTES
from ..grpc import GrpcOnLoop, GrpcService
from ..http.app import KServeApp
from ..http.h1 import H1Server
from ..metrics import Family
from ..protocol.shm import SharedMemory
from ..recovery import Recovery
from ..rollout import Traffic
from ..spec import ModelSpec
from ..tracing import Tracing
from .cached import FrontCache
from .exposition import merged_metrics_handler
from .forwarded import ForwardedModel
from .models import PyTritonModels, TritonModels
from .relay import GrpcRelay
from .window import Window, windows_figures

__all__ = ["Front"]


class Front:
    """``KServeApp`` over ``ForwardedModel``s, served by ``H1Server`` on its own thread:
    a checked infer request goes on to Triton from callbacks (``KServeApp.forward_now``).

    ``models``: name -> spec (PyTriton's, fixed), or a ``TritonModels`` registry;
    ``control_headers`` reach tritonserver's restricted APIs (the repository index).
    ``traffic``: each routed model's split (with ``routes`` on PyTriton: name -> version ->
    Triton model); ``grpc_port``: serve gRPC there too (``GrpcRelay``), passing calls on
    to tritonserver's private gRPC port ``grpc_url``; ``grpc_limits``: that server's
    connection limits (``ServerConfig.grpc_limits``).
    ``control_token`` guards ``POST /v2/models/<m>/traffic`` and Triton's shared-memory
    APIs (checked here, then passed on with ``control_headers``). ``demand``: the autoscaling
    signal's source (``TritonDemand``), exported on the front's ``/metrics``;
    ``http_limits``: the HTTP server's connection limits (``ServerConfig.http_limits``);
    ``recovery``: re-send requests whose worker died (``servekit.recovery``); the
    registry's models share it. ``local`` (PyTriton): models the front serves itself from
    servekit's core (``PyTritonModels``). ``metrics_port``: the public metrics port, where
    tritonserver's exposition (``triton_metrics_url``, a private port) is served merged
    with the front's own (``front.exposition``). ``windows`` (PyTriton): how many
    requests of each model are with tritonserver at once (``front.window``; the triton
    runtime's registry reads them from each model's config).
    """

    def __init__(
        self,
        models: Mapping[str, ModelSpec] | TritonModels,
        grpc_url: str,
        *,
        host: str,
        port: int,
        ready: Callable[[], bool],
        max_body_bytes: int = MAX_BODY_BYTES,
        inference_token: str | None = None,
        http_url: str,
        control_headers: Mapping[str, str] | None = None,
        traffic: Mapping[str, Traffic] | None = None,
        routes: Mapping[str, Mapping[int, str]] | None = None,
        grpc_port: int | None = None,
        control_token: str | None = None,
        exit_timeout_s: float = 10.0,
        demand: Callable[[], Iterable[Family]] | None = None,
        http_limits: Mapping[str, Any] | None = None,
        grpc_limits: Mapping[str, Any] | None = None,
        recovery: Recovery | None = None,
        tracing: Tracing | None = None,
        cached: Mapping[str, Callable[[], str]] | None = None,
        cache: ResponseCache | None = None,
        local: Mapping[str, Any] | None = None,
        metrics_port: int | None = None,
        triton_metrics_url: str | None = None,
        windows: Mapping[str, Window] | None = None,
    ) -> None:
        self.recovery, self.tracing, self.cache = recovery, tracing, cache
        # tritonserver maps the regions; the models the front serves itself read a
        # mirror of its system regions
        self.mirror = SharedMemory() if local else None
        self.registry: TritonModels | PyTritonModels = (
            models
            if isinstance(models, TritonModels)
            else PyTritonModels(
                {
                    name: ForwardedModel(
                        name,
                        spec,
                        grpc_url,
                        inference_token,
                        http_url=http_url,
                        recovery=recovery,
                    )  # fmt: skip
                    for name, spec in models.items()
                },
                http_url,
                control_headers or {},
                routes=routes,
                traffic=traffic,
                local=local,
            )
        )
        if isinstance(self.registry, PyTritonModels):
            for name, window in (windows or {}).items():
                self.registry.forwarded[name].window = window
        if isinstance(self.registry, PyTritonModels) and cache is not None:
            for name, identity in (cached or {}).items():
                self.registry.forwarded[name].cache = FrontCache(cache, name, identity)
        self.app = KServeApp(
            self.registry,
            max_body_bytes=max_body_bytes,
            ready=ready,
            inference_token=inference_token,
            control_token=control_token,
            tracing=tracing,
            shared_memory=self.mirror,
        )
        for t in (traffic or {}).values():
            self.app.metrics.watch_traffic(t)
        if demand is not None:
            self.app.metrics.collect(demand)
        if recovery is not None:
            self.app.metrics.collect(recovery.figures)
        if cache is not None:
            self.app.metrics.collect(cache.figures)
        self.app.metrics.collect(windows_figures(self._windows))
        self._relay = (
            GrpcRelay(
                GrpcService(
                    self.registry,
                    ready=ready,
                    inference_token=inference_token,
                    control_token=control_token,
                    on_failure=self.app.metrics.failed,
                    tracing=tracing,
                    shared_memory=self.mirror,
                ),
                self.registry,
                grpc_url,
                on_failure=self.app.metrics.failed,
                mirror=self.mirror,
            )
            if grpc_port is not None
            else None
        )
        self._grpc = (
            GrpcOnLoop(
                self._relay,
                host,
                grpc_port,
                max_body_bytes,
                exit_timeout_s,
                **(grpc_limits or {}),
            )  # fmt: skip
            if self._relay is not None and grpc_port is not None
            else None
        )
        ports = (
            {metrics_port: merged_metrics_handler(triton_metrics_url, self.app.metrics.render)}
            if metrics_port is not None and triton_metrics_url is not None
            else {}
        )
        self._http = H1Server(
            self.app.handle,
            host,
            port,
            fast=self.app.forward_now,
            max_body_bytes=max_body_bytes,
            ports=ports,
            **(http_limits or {}),
            name="servekit-front",
            on_start=self._grpc.start if self._grpc is not None else None,
            on_exit=self._close,
        )

    def _windows(self) -> list[Window]:
        registry = self.registry
        if isinstance(registry, PyTritonModels):
            return [m.window for m in registry.forwarded.values() if m.window is not None]
        return registry.windows()

    def start(self, timeout_s: float = 30.0) -> Front:
        self._http.start(timeout_s)
        return self

    async def _close(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop()
        if self._relay is not None:
            await self._relay.aclose()
        await self.registry.aclose()
        if self.cache is not None:
            await self.cache.store.aclose()
        if self.mirror is not None:
            self.mirror.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._http.stop(timeout_s)
        if self.tracing is not None:
            self.tracing.shutdown()  # what is still buffered goes out first
