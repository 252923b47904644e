"""The ASGI side of ``KServeApp``: one request from an ASGI server (uvicorn, Ray Serve's
ingress) as an ``HttpRequest`` for ``handle``, its answer back, and ``serve_http`` to run
an app under uvicorn. servekit's own HTTP/1.1 server (``h1``) calls ``handle`` directly."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from .messages import Answer, HttpRequest

if TYPE_CHECKING:
    from .app import KServeApp

__all__ = ["serve_asgi", "serve_http"]


async def serve_asgi(
    handle: Callable[[HttpRequest], Awaitable[Answer]],
    max_body_bytes: int,
    scope: dict[str, Any],
    receive: Callable[..., Any],
    send: Callable[..., Any],
) -> None:
    """One ASGI call: lifespan messages acknowledged, an HTTP request answered by ``handle``
    (a body over ``max_body_bytes`` read and dropped, never kept)."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    headers = {
        k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
    }
    body, oversize = await _receive_body(headers, receive, max_body_bytes)
    request = HttpRequest(
        scope["method"], scope["path"], headers, body,
        query=scope.get("query_string", b""), oversize=oversize, limit=max_body_bytes,
    )  # fmt: skip
    status, payload, out = await handle(request)
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in out.items()]
    if isinstance(payload, bytes):
        raw.append((b"content-length", b"%d" % len(payload)))
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": payload})
        return
    await send({"type": "http.response.start", "status": status, "headers": raw})
    async with contextlib.aclosing(payload):  # type: ignore[type-var]
        async for chunk in payload:  # a streamed answer (Server-Sent Events)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _receive_body(
    headers: Mapping[str, str], receive: Callable[..., Any], limit: int
) -> tuple[bytes, int]:
    """The ASGI body and, past ``limit``, its size (read and dropped, never kept)."""
    declared = headers.get("content-length", "0")
    size = int(declared) if declared.isdigit() else 0
    if size > limit:
        return b"", size
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif chunks:
            chunks.clear()
        if not message.get("more_body"):
            break
    return (b"".join(chunks), 0) if size <= limit else (b"", size)


def serve_http(
    app: KServeApp, host: str = "0.0.0.0", port: int = 8000, log_level: str = "warning"
) -> None:
    """Run the front with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
