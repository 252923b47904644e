"""An ASGI app served by uvicorn on a thread of its own (the fronts of every in-process runtime)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["AsgiThread", "MetricsApp"]


class AsgiThread:
    """uvicorn serving ``app`` on ``host:port`` from a daemon thread; ``start`` returns once
    it listens, ``stop`` waits for requests in flight. ``on_start`` runs on the server's
    loop before it listens (another server sharing the loop), ``on_exit`` after it stops
    (closing what belongs to that loop)."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        name: str = "servekit-http",
        on_start: Callable[[], Awaitable[None]] | None = None,
        on_exit: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.app, self.host, self.port, self.name = app, host, port, name
        self._on_start, self._on_exit = on_start, on_exit
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> AsgiThread:
        import uvicorn

        config = uvicorn.Config(
            self.app, host=self.host, port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the caller owns the signals
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive():
                raise OSError(f"{self.name} could not listen on {self.host}:{self.port}")
            threading.Event().wait(0.02)
            waited += 0.02
            if waited >= timeout_s:
                raise TimeoutError(f"{self.name} did not start within {timeout_s} s")
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        async def main() -> None:
            try:
                if self._on_start is not None:
                    await self._on_start()
                await self._server.serve()
            finally:
                if self._on_exit is not None:
                    await self._on_exit()

        asyncio.run(main())

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


class MetricsApp:
    """``GET /metrics`` alone: the Prometheus exposition on a metrics port of its own."""

    def __init__(self, render: Callable[[], str]) -> None:
        self.render = render

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return
        from ..metrics import CONTENT_TYPE

        if scope["path"].rstrip("/") == "/metrics" and scope["method"] == "GET":
            status, body, kind = 200, self.render().encode(), CONTENT_TYPE
        else:
            status, body, kind = (
                404,
                b'{"error": "only GET /metrics is served here"}',
                "application/json",
            )
        headers = [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
