"""``NativeServer``: servekit's KServe v2 server over its ``Batcher``s, in one process.

Every model of the ``ServeConfig`` is loaded into ``ServedModels`` and batched by a
``Batcher`` with the model's own ``BatchingPolicy`` and ``instances`` worker threads;
KServe v2 is answered over HTTP on ``http_port`` (the hardened front) and over gRPC on
``grpc_port`` (Triton's ``GRPCInferenceService``), both on one event loop, and the
Prometheus metrics on ``metrics_port``.
Readiness turns true once every model is warm.
"""

from __future__ import annotations

import asyncio
import logging

from ..config import ServeConfig
from ..grpc import GrpcOnLoop, GrpcService
from ..http.app import KServeApp, metrics_handler
from ..http.h1 import H1Server
from ..protocol.shm import SharedMemory
from ..runtime.registry import ServedModels, response_cache
from ..store import ModelStore, StoreModels, store_app

__all__ = ["NativeServer"]

log = logging.getLogger(__name__)


class NativeServer:
    """servekit's own server: start, use, stop (or a context manager)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config.check("native")
        self.models = ServedModels(self.config)
        """What it serves: each model's versions, traffic and Batchers."""
        self.app: KServeApp | None = None
        self.store: ModelStore | None = None
        """The ``[store]``'s models, when the config has one."""
        self._threads: list[H1Server] = []
        self._ready = False
        self.shared_memory = SharedMemory()
        """The regions clients register (Triton's system shared memory), on HTTP and gRPC."""
        self.cache = response_cache(self.config)
        """The response cache (``[server.cache]``) of the models with ``response_cache``."""
        self.tracing = self.config.server.tracing.tracing()
        """Traces of requests (``[server.tracing]``); its settings outlive a restart."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> NativeServer:
        return cls(config)

    def start(self) -> NativeServer:
        """Load and warm up every model, then listen; returns once both ports answer."""
        c = self.config
        if c.server.log_verbose:
            logging.getLogger("servekit").setLevel(logging.DEBUG)
        try:
            if c.store.active:
                self._start_store()
                return self
            self.models.load()  # a restart keeps the warm runners
            self.app = KServeApp(
                self.models.batch(self.cache),
                max_body_bytes=c.server.max_body_bytes,
                ready=lambda: self._ready,
                inference_token=c.server.inference_token,
                control_token=c.server.control_token,
                shared_memory=self.shared_memory,
                tracing=self.tracing,
            )
            self.app.metrics.autoscale.update(c.autoscale_policies())
            if self.cache is not None:
                self.app.metrics.collect(self.cache.figures)
            self._listen(self.app)
        except BaseException:
            self._shutdown()
            raise
        self._ready = True
        log.info("serving %s on %s", self.models.names(), c.server.listening())
        return self

    def _listen(self, app: KServeApp) -> H1Server:
        """Serve ``app`` on the HTTP, gRPC and metrics ports, all on one event loop."""
        c = self.config
        grpc = GrpcService(
            app.models,
            ready=lambda: self._ready,
            inference_token=c.server.inference_token,
            control_token=c.server.control_token,
            on_failure=app.metrics.failed,
            shared_memory=app.shared_memory,
            tracing=app.tracing,
        )
        on_loop = GrpcOnLoop(
            grpc, c.server.host, c.server.grpc_port, c.server.max_body_bytes,
            c.server.exit_timeout_s, **c.server.grpc_limits(),
        )  # fmt: skip
        server = H1Server(
            app.handle,
            c.server.host,
            c.server.http_port,
            ports={c.server.metrics_port: metrics_handler(app.metrics.render)},
            max_body_bytes=c.server.max_body_bytes,
            **c.server.http_limits(),
            name="servekit-native",
            on_start=on_loop.start,
            on_exit=on_loop.stop,
        ).start()
        self._threads = [server]
        return server

    def _start_store(self) -> None:
        """Serve the ``[store]``: listen at once, then load what it loads at start (pins;
        every model when ``load = "eager"``); ready once those are resident."""
        c = self.config
        self.app, self.store = store_app(
            c, ready=lambda: self._ready, shared_memory=self.shared_memory, tracing=self.tracing
        )
        assert isinstance(self.app.models, StoreModels)
        self.models.traffic = self.app.models.traffic  # what SIGHUP's re-read file changes
        server = self._listen(self.app)
        asyncio.run_coroutine_threadsafe(self.store.start(), server.loop).result()
        self._ready = True
        log.info(
            "serving a store of %d models on %s", len(self.store.known()), c.server.listening()
        )

    def problem(self) -> str | None:
        dead = [t.name for t in self._threads if not t.is_alive()]
        return f"{dead} stopped unexpectedly" if dead else None

    def restart(self) -> None:
        self._shutdown()
        self.start()

    def reload(self) -> list[str]:
        """Read each model's file again and swap it in between batches (no request fails)."""
        if self.store is not None:
            raise ValueError(
                "a [store]'s models reload through the repository API "
                "(POST /v2/repository/models/<m>/load), not on SIGHUP"
            )
        return self.models.reload()

    def _shutdown(self) -> None:
        self._ready = False
        if self.cache is not None and self._threads and self._threads[0].is_alive():
            closing = asyncio.run_coroutine_threadsafe(
                self.cache.store.aclose(), self._threads[0].loop
            )
            closing.result(10)
        if self.store is not None and self._threads and self._threads[0].is_alive():
            done = asyncio.run_coroutine_threadsafe(self.store.close(), self._threads[0].loop)
            done.result(self.config.server.exit_timeout_s + 30)
        self.store = None
        for thread in self._threads:
            thread.stop(self.config.server.exit_timeout_s + 5)
        self._threads = []
        self.models.close_batchers()

    def stop(self) -> None:
        """Stop listening, drain the Batchers and close the runners."""
        self._shutdown()
        self.models.close()
        self.shared_memory.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # what is still buffered goes out first

    def __enter__(self) -> NativeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
