"""servekit's own HTTP/1.1 server: asyncio Protocols, httptools' parser, uvloop when installed.

It calls a ``Handler`` (``KServeApp.handle``) with each request's method, path, headers
(decoded once) and body, and writes the answer it returns; no ASGI scope or messages
(``KServeApp`` keeps an ASGI adapter for uvicorn and Ray). A request that the ``fast``
hook can answer without awaiting anything of its own (checked, then handed to a pooled
connection that calls back) is answered from callbacks, with no task per request. On one
connection requests are answered in order (pipelining). Bodies over ``max_body_bytes`` are
read and dropped, never buffered (reading ``HttpRequest.body`` then raises
``PayloadTooLarge``: a 413, after the handler has routed the request); headers over
``max_header_bytes`` are refused (431). Idle connections close after ``keep_alive_s``.
Further ports (``ports``) are served by their own handlers on the same loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import http
import json
import logging
import threading
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import NamedTuple

import httptools

from ..config import MAX_BODY_BYTES
from ..errors import ServekitError, http_status
from .messages import FastPath, Handler, HttpRequest

__all__ = ["H1Server", "new_loop"]

log = logging.getLogger(__name__)

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_MAX_PENDING = 16
"""Pipelined requests queued on one connection before it stops reading."""


class _Request(NamedTuple):
    method: str
    target: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool
    error: tuple[int, str] | None
    oversize: int


_JSON = {"content-type": "application/json"}


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class _Connection(asyncio.Protocol):
    """One client connection: parse, answer in order, keep alive."""

    def __init__(self, server: H1Server, handler: Handler, fast: FastPath | None) -> None:
        self.server, self.handler, self.fast = server, handler, fast
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.keep = True
        self.pending: collections.deque[_Request] = collections.deque()
        self.paused = False
        self.discarding = False
        self.last = self.loop.time()
        """When the connection last went idle (the server's sweep closes it after keep_alive_s)."""
        self.handling: asyncio.Task[None] | None = None
        """The task awaiting an inference's answer, cancelled if the peer leaves."""
        self.streaming: asyncio.Task[None] | None = None
        """The task writing a streamed answer (Server-Sent Events), cancelled if the peer leaves."""
        self.writable: asyncio.Event | None = None
        """Clear while the peer leaves our writes unread (a streamed answer waits on it)."""
        self.leave: Callable[[], None] | None = None
        """Tells the fast path the peer left before its answer (``FastPath``)."""
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.oversize = 0
        self.header_bytes = 0
        self.error: tuple[int, str] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.server.max_connections:
            body = _error_body("too many connections; try again")
            head = (
                f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
            )
            transport.write(head.encode() + body)  # type: ignore[attr-defined]
            transport.close()
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self.pending.clear()
        if self.handling is not None:
            self.handling.cancel()
        if self.leave is not None:  # called once: the connection is gone
            self.leave()
        if self.streaming is not None:
            self.streaming.cancel()
        if self.writable is not None:
            self.writable.set()

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = asyncio.Event()
        self.writable.clear()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self.header_bytes += len(url)
        if self.header_bytes > self.server.max_header_bytes:
            if self.error is None:
                self.error = (414, f"request target exceeds {self.server.max_header_bytes} bytes")
            return
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > self.server.max_header_bytes:
            if self.error is None:
                self.error = (431, f"request headers exceed {self.server.max_header_bytes} bytes")
            return
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        expect = False
        for name, value in self.headers:
            if name == b"content-length":
                declared = int(value) if value.isdigit() else 0
                if declared > self.server.max_body_bytes:
                    self.oversize = declared
            elif name == b"expect" and value.lower() == b"100-continue":
                expect = True
        if self.error is not None:
            self._refuse_early()
        elif expect and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.error is not None or self.oversize:
            return
        if self.size > self.server.max_body_bytes:
            self.oversize = self.size
            self.body.clear()
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.discarding:  # refused already; the client has finished sending it
            if self.transport is not None:
                self.transport.close()
            return
        request = _Request(
            self.parser.get_method().decode("latin-1"),
            self.url,
            self.headers,
            b"".join(self.body),
            self.parser.should_keep_alive(),
            self.error,
            self.oversize,
        )
        if self.busy:
            self.pending.append(request)
            if len(self.pending) >= _MAX_PENDING and self.transport is not None:
                self.transport.pause_reading()
                self.paused = True
        else:
            self._start(request)

    # answering
    def _refuse_early(self) -> None:
        """Answer a refused request before its body has come (the client may read the
        answer while it sends), then read and drop the body, and close."""
        if self.busy or self.pending or self.error is None:
            return  # answered in its turn
        status, message = self.error
        self._refuse(status, message, close=False)
        self.discarding = True

    def _refuse(self, status: int, message: str, *, close: bool = True) -> None:
        self.keep = False
        self.busy = True
        self._reply(status, _error_body(message), {"content-type": "application/json"}, close=close)

    def _start(self, request: _Request) -> None:
        self.busy = True
        self.keep = request.keep_alive and not self.server.stopping
        if request.error is not None:
            self._refuse(*request.error)
            return
        target = request.target
        if b"?" in target or b"%" in target or not target.startswith(b"/"):
            try:
                url = httptools.parse_url(target)
            except httptools.HttpParserInvalidURLError:
                self._refuse(400, f"malformed request target {target[:200]!r}")
                return
            path, query = urllib.parse.unquote(url.path.decode("latin-1")), url.query or b""
        else:
            path, query = target.decode("latin-1"), b""
        fast = self.fast
        if fast is not None and not request.oversize:
            try:
                taken = fast(request.method, path, request.headers, request.body, self._reply)
                if taken:
                    if callable(taken) and self.busy:  # not answered yet
                        self.leave = taken
                    return
            except Exception as exc:  # a bug on the fast path is that request's 500, as on the slow
                log.exception("unexpected error on %s %s", request.method, path)
                if self.busy:
                    self._reply(500, _error_body(f"internal error: {type(exc).__name__}"), {})
                return
        task = self.loop.create_task(self._handle(request, path, query))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)
        if path.endswith("/infer"):  # an answer nobody will read is not computed
            self.handling = task

    def _reply(
        self,
        status: int,
        body: bytes,
        headers: Mapping[str, str],
        *,
        close: bool = True,
        head: bool = False,
    ) -> None:
        """Write the answer; ``head``: its headers only, as a HEAD request is answered."""
        transport = self.transport
        self.busy, self.leave = False, None
        if transport is None or transport.is_closing():
            return
        lines = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        for key, value in headers.items():
            lines += b"%s: %s\r\n" % (key.encode("latin-1"), value.encode("latin-1"))
        lines += b"content-length: %d\r\n" % len(body)
        if not self.keep:
            lines += b"connection: close\r\n"
        transport.write(lines + b"\r\n" + (b"" if head else body))
        self._next(transport, close)

    def _next(self, transport: asyncio.Transport, close: bool = True) -> None:
        """An answer is written: close, or take the next request in line."""
        if not self.keep:
            self.busy = True  # nothing more is answered on this connection
            if close:
                transport.close()
        elif self.pending:
            if self.paused and len(self.pending) < _MAX_PENDING // 2:
                transport.resume_reading()
                self.paused = False
            self._start(self.pending.popleft())
        else:
            self.last = self.loop.time()
            if self.server.stopping:
                transport.close()

    async def _handle(self, request: _Request, path: str, query: bytes) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
        limit = self.server.max_body_bytes
        try:
            status, body, out = await self.handler(
                HttpRequest(
                    request.method, path, headers, request.body,
                    query=query, oversize=request.oversize, limit=limit,
                )
            )  # fmt: skip
        except asyncio.CancelledError:
            if self.transport is not None:
                raise
            return  # the peer left while it waited: nobody reads an answer
        except ServekitError as exc:
            self._reply(http_status(exc), _error_body(str(exc)), _JSON)
            return
        except Exception as exc:  # one request's failure never takes the connection's server down
            log.exception("unexpected error on %s %s", request.method, path)
            self._reply(500, _error_body(f"internal error: {type(exc).__name__}"), {})
            return
        finally:
            if self.handling is asyncio.current_task():
                self.handling = None
        if request.method == "HEAD" and isinstance(body, bytes):
            self._reply(status, body, out, head=True)
        elif isinstance(body, bytes):
            self._reply(status, body, out)
        else:
            await self._stream(status, body, out)

    async def _stream(
        self, status: int, chunks: AsyncIterator[bytes], headers: Mapping[str, str]
    ) -> None:
        """A streamed answer (Server-Sent Events): each chunk written as it comes, chunked,
        waiting while the peer does not read; a peer that leaves cancels it, which closes
        ``chunks`` (and the model behind it) at once."""
        transport = self.transport
        self.busy = False
        if transport is None or transport.is_closing():
            await chunks.aclose()  # type: ignore[attr-defined]
            return
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        for key, value in headers.items():
            head += b"%s: %s\r\n" % (key.encode("latin-1"), value.encode("latin-1"))
        head += b"transfer-encoding: chunked\r\n"
        if not self.keep:
            head += b"connection: close\r\n"
        self.streaming = asyncio.current_task()
        transport.write(head + b"\r\n")
        try:
            async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                async for chunk in chunks:
                    if self.transport is None:
                        return
                    transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    if self.writable is not None:
                        await self.writable.wait()
            transport.write(b"0\r\n\r\n")
        except asyncio.CancelledError:
            return  # the peer left
        except Exception:  # the status is sent: all that is left is to end the connection
            log.exception("a streamed answer failed")
            self.keep = False
            transport.close()
            return
        finally:
            self.streaming = None
        self._next(transport)


class H1Server:
    """``handler`` on ``host:port`` from a daemon thread with a loop of its own (uvloop when
    installed), and each of ``ports`` (port -> handler) on the same loop; ``start`` returns
    once all listen, ``stop`` answers the requests in flight (up to ``timeout_s``), then
    closes every connection. ``on_start`` runs on the loop before it listens (another
    server sharing the loop), ``on_exit`` after it stops (closing what belongs to that loop)."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        fast: FastPath | None = None,
        ports: Mapping[int, Handler] | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_header_bytes: int = 64 * 1024,
        keep_alive_s: float = 5.0,
        max_connections: int = 1024,
        name: str = "servekit-http",
        on_start: Callable[[], Awaitable[None]] | None = None,
        on_exit: Callable[[], Awaitable[None]] | None = None,
        reuse_port: bool = False,
    ) -> None:
        self.handler, self.host, self.port, self.name, self.fast = handler, host, port, name, fast
        self.ports = dict(ports or {})
        self.max_body_bytes, self.max_header_bytes = max_body_bytes, max_header_bytes
        self.keep_alive_s, self.max_connections = keep_alive_s, max_connections
        self._on_start, self._on_exit = on_start, on_exit
        self.reuse_port = reuse_port
        """``port`` shared with other servers that set it (``SO_REUSEPORT``: the kernel
        spreads connections over them)."""
        self.loop: asyncio.AbstractEventLoop = new_loop()
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self._listening = threading.Event()
        self._failed: BaseException | None = None
        self._stop: asyncio.Event | None = None
        self._drain_s = 10.0
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> H1Server:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if not self._listening.wait(timeout_s):
            raise TimeoutError(f"{self.name} did not start within {timeout_s} s")
        if self._failed is not None:
            raise OSError(
                f"{self.name} could not listen on {self.host}:{self.port}: {self._failed}"
            )
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        listeners = [(self.port, self.handler, self.fast)]
        listeners += [(port, handler, None) for port, handler in self.ports.items()]
        servers: list[asyncio.AbstractServer] = []
        try:
            if self._on_start is not None:
                await self._on_start()
            for port, handler, fast in listeners:
                servers.append(
                    await self.loop.create_server(
                        functools.partial(_Connection, self, handler, fast),
                        self.host, port, backlog=2048,
                        reuse_port=self.reuse_port and port == self.port or None,
                    )
                )  # fmt: skip
        except Exception as exc:
            for server in servers:
                server.close()
            self._failed = exc
            self._listening.set()
            if self._on_exit is not None:
                with contextlib.suppress(Exception):
                    await self._on_exit()
            return
        self._listening.set()
        sweep = self.loop.create_task(self._sweep())
        try:
            await self._stop.wait()
        finally:
            self.stopping = True
            sweep.cancel()
            for server in servers:
                server.close()
            deadline = self.loop.time() + self._drain_s
            while (
                any(c.busy for c in self.connections) or self.tasks
            ) and self.loop.time() < deadline:
                await asyncio.sleep(0.02)
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.close()
            if self._on_exit is not None:
                with contextlib.suppress(Exception):
                    await self._on_exit()

    async def _sweep(self) -> None:
        """Close connections idle for ``keep_alive_s`` (one timer for all, not one a request)."""
        while True:
            await asyncio.sleep(min(1.0, self.keep_alive_s / 2))
            horizon = self.loop.time() - self.keep_alive_s
            for conn in list(self.connections):
                if not conn.busy and conn.last < horizon and conn.transport is not None:
                    conn.transport.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._drain_s = max(0.0, timeout_s - 1.0)
        if self._stop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended already
                self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout_s)
        self._thread = None


def new_loop() -> asyncio.AbstractEventLoop:
    """The event loop servekit's servers run on: uvloop's where installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
