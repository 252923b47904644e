"""Forward a checked request to tritonserver's own HTTP port, body untouched.

servekit's front checks every request before Triton sees it; once checked, the cheapest
way on is the way it came: the same bytes, over a keep-alive HTTP/1.1 connection on
loopback, and Triton's answer passed back as it is. No tensors are rebuilt, re-encoded
or decoded again on the way, and no task is made per request: a pooled connection
takes the bytes and calls back with the answer (``send``); ``post`` awaits the same. A
reused connection that the server closed meanwhile is replaced once, transparently. A
connection is pooled again only when its last exchange was clean: one that carries an
answer no request asked for, or answered before the request was all written, is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import httptools

from ..errors import ModelNotReady, ServekitError

__all__ = ["Answer", "Done", "Dropped", "HttpForwarder"]

Answer = tuple[int, bytes, dict[str, str]]
"""(status, body, headers) of the server's answer; headers are the ones passed back."""
Done = Callable[[Answer | ServekitError], None]


class Dropped(ModelNotReady):
    """The server closed the connection with the request sent and no answer begun: it
    died (or was killed) with the request in flight."""


_PASSED_BACK = frozenset({b"content-type", b"inference-header-content-length", b"retry-after"})


class _Connection(asyncio.Protocol):
    """One keep-alive connection to the server; one request at a time."""

    def __init__(self, pool: HttpForwarder) -> None:
        self.pool = pool
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: Done | None = None
        self.request = b""
        self.answered = False  # some of the answer has arrived: never resend
        self.retry = False
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, done: Done, *, retry: bool) -> None:
        assert self.transport is not None
        self.done, self.request, self.retry, self.answered = done, request, retry, False
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self.done is None:  # bytes no request asked for: what follows them is unknowable
            self._drop()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ModelNotReady(f"tritonserver's answer is not HTTP: {exc}"))

    def on_message_begin(self) -> None:
        self._headers, self._body = {}, []

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in _PASSED_BACK:
            self._headers[name.decode()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        done, self.done = self.done, None
        if done is None:  # an answer no request asked for (after one that did)
            self._drop()
            return
        answer = (self.parser.get_status_code(), b"".join(self._body), self._headers)
        t = self.transport
        # Answered before the whole request was written, the server would read the rest
        # as the next request's start: only a connection clean both ways is reused.
        if (
            self.parser.should_keep_alive()
            and t is not None
            and not t.is_closing()
            and not t.get_write_buffer_size()
        ):
            self.pool.idle.append(self)
        else:
            self._drop()
        done(answer)

    def _drop(self) -> None:
        """Out of the pool and closed."""
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        if self.done is None:
            return
        if self.retry and not self.answered:  # closed while idle in the pool: once more, fresh
            done, self.done = self.done, None
            self.pool.connect_and_send(self.request, done, dropped=True)
            return
        self._fail(Dropped(f"tritonserver dropped the connection: {exc or 'closed'}"))

    def _fail(self, error: ServekitError) -> None:
        done, self.done = self.done, None
        if self.transport is not None:
            self.transport.close()
        if done is not None:
            done(error)


class HttpForwarder:
    """POSTs bodies to ``http://host:port`` on pooled keep-alive connections (one event loop)."""

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None) -> None:
        hostport = url.removeprefix("http://").rstrip("/")
        self.host, _, port = hostport.rpartition(":")
        self.port = int(port)
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._host_line = f"Host: {self.host}:{self.port}\r\n{extra}".encode("latin-1")
        self.idle: list[_Connection] = []
        self._heads: dict[str, bytes] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def request_bytes(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> bytes:
        head = self._heads.get(path)
        if head is None:
            head = self._heads[path] = b"POST %s HTTP/1.1\r\n%s" % (
                path.encode("latin-1"),
                self._host_line,
            )
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        return b"%sContent-Length: %d\r\n%s\r\n%s" % (
            head,
            len(body),
            extra.encode("latin-1"),
            body,
        )

    def send(self, request: bytes, done: Done) -> None:
        """Send a whole request (``request_bytes``); ``done`` gets the answer or a
        ``ModelNotReady``, on the loop, once."""
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                conn.send(request, done, retry=True)
                return
        self.connect_and_send(request, done)

    def connect_and_send(self, request: bytes, done: Done, *, dropped: bool = False) -> None:
        """Send on a new connection. ``dropped``: a reused one closed with the request sent,
        so if the server cannot be reached now, it died with the request (``Dropped``)."""
        task = asyncio.get_running_loop().create_task(
            self._connect_and_send(request, done, dropped)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect_and_send(self, request: bytes, done: Done, dropped: bool) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except OSError as exc:
            error = Dropped if dropped else ModelNotReady
            done(error(f"tritonserver is not answering: {exc}"))
            return
        conn.send(request, done, retry=False)

    async def exchange(self, request: bytes) -> Answer | ServekitError:
        """``send``, awaited: the answer, or the error saying why there is none."""
        future: asyncio.Future[Answer | ServekitError] = asyncio.get_running_loop().create_future()
        self.send(request, lambda answer: None if future.done() else future.set_result(answer))
        return await future

    async def post(self, path: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        """One request, awaited; raises ``ModelNotReady`` when tritonserver cannot be reached."""
        answer = await self.exchange(self.request_bytes(path, body, headers))
        if isinstance(answer, ServekitError):
            raise answer
        return answer

    async def close(self) -> None:
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None:
                conn.transport.close()
