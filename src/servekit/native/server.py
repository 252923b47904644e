"""``NativeServer``: servekit's KServe v2 server over its ``Batcher``s, in one process.

Every model of the ``ServeConfig`` is loaded through ``load_models`` and batched by a
``Batcher`` with the model's own ``BatchingPolicy`` and ``instances`` worker threads;
KServe v2 is answered over HTTP on ``http_port`` (the hardened front) and over gRPC on
``grpc_port`` (Triton's ``GRPCInferenceService``), both on one event loop, and the
Prometheus metrics on ``metrics_port``.
Readiness turns true once every model is warm.
"""

from __future__ import annotations

import logging

from ..batching import Batcher
from ..config import ServeConfig
from ..grpc import GrpcOnLoop, GrpcService
from ..http.app import KServeApp, metrics_handler
from ..http.h1 import H1Server
from ..protocol.routed import route, traffic_of
from ..rollout import Traffic
from ..runtime.base import ServedModel, load_models, reload_models

__all__ = ["NativeServer"]

log = logging.getLogger(__name__)


class NativeServer:
    """servekit's own server: start, use, stop (or a context manager)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config.check("native")
        self.models: list[ServedModel] = []
        self.batchers: dict[str, Batcher] = {}
        self.app: KServeApp | None = None
        self.traffic: dict[str, Traffic] = {}
        """Each versioned model's split and canary, kept across restarts."""
        self._threads: list[H1Server] = []
        self._ready = False

    @classmethod
    def from_config(cls, config: ServeConfig) -> NativeServer:
        return cls(config)

    def start(self) -> NativeServer:
        """Load and warm up every model, then listen; returns once both ports answer."""
        c = self.config
        if c.server.log_verbose:
            logging.getLogger("servekit").setLevel(logging.DEBUG)
        try:
            if not self.models:  # a restart keeps the warm runners
                self.models = [m for model in c.models for m in load_models(model, c.cache_dir)]
                for m in self.models:
                    m.runner.warmup()
            self.batchers = {}
            by_name: dict[str, dict[int, Batcher]] = {}  # name -> version -> Batcher
            for m in self.models:
                batcher = Batcher(m.runner, m.policy, instance_count=m.instance_count, name=m.name)
                self.batchers[m.name if m.version == 1 else f"{m.name}@v{m.version}"] = batcher
                by_name.setdefault(m.name, {})[m.version] = batcher
            self.traffic = self.traffic or traffic_of(c)
            self.app = KServeApp(
                route(by_name, self.traffic),
                max_body_bytes=c.server.max_body_bytes,
                ready=lambda: self._ready,
                inference_token=c.server.inference_token,
                control_token=c.server.control_token,
            )
            app = self.app
            grpc = GrpcService(
                app.models,
                ready=lambda: self._ready,
                inference_token=c.server.inference_token,
                on_failure=app.metrics.failed,
            )
            on_loop = GrpcOnLoop(
                grpc, c.server.host, c.server.grpc_port, c.server.max_body_bytes,
                c.server.exit_timeout_s,
            )  # fmt: skip
            self._threads = [
                H1Server(
                    app.handle,
                    c.server.host,
                    c.server.http_port,
                    ports={c.server.metrics_port: metrics_handler(app.metrics.render)},
                    max_body_bytes=c.server.max_body_bytes,
                    name="servekit-native",
                    on_start=on_loop.start,
                    on_exit=on_loop.stop,
                ).start(),
            ]
        except BaseException:
            self._shutdown()
            raise
        self._ready = True
        log.info("serving %s on %s", list(self.batchers), c.server.http_url)
        return self

    def problem(self) -> str | None:
        dead = [t.name for t in self._threads if not t.is_alive()]
        return f"{dead} stopped unexpectedly" if dead else None

    def restart(self) -> None:
        self._shutdown()
        self.start()

    def reload(self) -> list[str]:
        """Read each model's file again and swap it in between batches (no request fails)."""
        return reload_models(self.config, self.models)

    def _shutdown(self) -> None:
        self._ready = False
        for thread in self._threads:
            thread.stop(self.config.server.exit_timeout_s + 5)
        self._threads = []
        for batcher in self.batchers.values():
            batcher.close()
        self.batchers = {}

    def stop(self) -> None:
        """Stop listening, drain the Batchers and close the runners."""
        self._shutdown()
        closed: set[int] = set()
        for m in self.models:
            if id(m.runner) not in closed:
                closed.add(id(m.runner))
                m.runner.close()
        self.models = []

    def __enter__(self) -> NativeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
