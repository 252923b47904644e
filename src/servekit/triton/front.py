"""servekit's hardened KServe v2 front on Triton's public HTTP port.

tritonserver 2.51 (the one PyTriton 0.7 bundles) aborts on one JSON request whose shape
claims more elements than memory holds, and answers malformed ``data`` with 500s. With
``ServerConfig(front=True)`` (``servekit serve --front``) Triton's HTTP endpoint moves
to loopback on a private port and the public HTTP port is servekit's ``KServeApp``: it
decodes and checks every request against the model's spec before anything is
allocated (the same code as the Ray front), then forwards the tensors to Triton over
gRPC on loopback, which refuses the same hostile requests cleanly, so gRPC stays
public. What the front does not carry (shared-memory registration, repository and
statistics APIs) remains on Triton's gRPC port.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..spec import ModelSpec

__all__ = ["ForwardedModel", "Front"]

log = logging.getLogger(__name__)


class ForwardedModel:
    """A model Triton serves, as the front sees it: the spec, and ``infer`` over gRPC."""

    accepts_scheduling = True
    """The front passes Triton's ``priority`` / ``timeout`` request parameters through."""

    def __init__(self, name: str, spec: ModelSpec, grpc_url: str, token: str | None = None) -> None:
        self.name, self.spec, self.url, self._token = name, spec, grpc_url, token
        self._client: Any = None

    async def infer(
        self, inputs: Mapping[str, np.ndarray], priority: int = 0, timeout_us: int | None = None
    ) -> dict[str, np.ndarray]:
        self.spec.validate_inputs(inputs)
        if self._client is None:  # a gRPC aio channel belongs to the loop that made it
            from ..client import AsyncClient

            self._client = AsyncClient(self.url, inference_token=self._token)
        return await self._client.infer(self.name, inputs, priority=priority, timeout_us=timeout_us)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None


class Front:
    """``KServeApp`` over ``ForwardedModel``s, served by uvicorn on its own thread."""

    def __init__(
        self,
        models: Mapping[str, ModelSpec],
        grpc_url: str,
        *,
        host: str,
        port: int,
        ready: Callable[[], bool],
        max_body_bytes: int = 64 * 1024 * 1024,
        inference_token: str | None = None,
    ) -> None:
        from ..http import KServeApp

        self.forwarded = [
            ForwardedModel(name, spec, grpc_url, inference_token) for name, spec in models.items()
        ]
        self.app = KServeApp(
            {m.name: m for m in self.forwarded},
            max_body_bytes=max_body_bytes,
            ready=ready,
            inference_token=inference_token,
        )
        self.host, self.port = host, port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> Front:
        import uvicorn

        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the caller owns the signals
        self._thread = threading.Thread(target=self._run, name="servekit-front", daemon=True)
        self._thread.start()
        deadline = timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"the HTTP front could not listen on {self.host}:{self.port}")
            threading.Event().wait(0.02)
            deadline -= 0.02
            if deadline <= 0:
                raise TimeoutError(f"the HTTP front did not start within {timeout_s} s")
        return self

    def _run(self) -> None:
        async def main() -> None:
            try:
                await self._server.serve()
            finally:
                for m in self.forwarded:
                    await m.aclose()

        asyncio.run(main())

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
