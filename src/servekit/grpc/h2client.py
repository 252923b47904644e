"""A lean gRPC client: unary calls as message bytes over one HTTP/2 connection, on the
running loop (what the front's gRPC relay sends tritonserver, ``front.relay``).

grpc.aio's client cost the relay about 300 us of CPU per call here (its completion-queue
thread and per-call objects, BENCHMARKS.md "The serving path's cost"); this one writes a
call's frames from the loop (request headers are HPACK literals, encoded once per path
and metadata) and reads the answer as bytes. Flow control both ways, the peer's
SETTINGS, PING, GOAWAY and RST_STREAM are honoured; a connection that closes fails its
calls with UNAVAILABLE saying whether the call had been sent, and the next call
connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from collections.abc import Sequence
from typing import Any, cast

import hpack

from .frames import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    INTERNAL,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY_FLAG,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    SETTINGS,
    UNAVAILABLE,
    WINDOW_UPDATE,
    frame,
    literal,
    next_frame,
)
from .h2frames import BlockDecoder

__all__ = ["H2Call", "H2Client", "UNAVAILABLE"]

_ENABLE_PUSH = 2
_RECEIVE_FRAME = 1 << 20
"""The largest frame this client takes (advertised)."""
_LAST_STREAM = (1 << 31) - 1

H2Call = tuple[int, str, bytes]
"""A call's end: its gRPC status code, message and (status 0) its reply message's bytes."""


class _Call:
    __slots__ = ("done", "headers", "body", "out", "send_window")

    def __init__(self, done: asyncio.Future[H2Call], out: bytes, send_window: int) -> None:
        self.done, self.out, self.send_window = done, out, send_window
        self.headers: dict[bytes, bytes] = {}
        self.body = bytearray()


class _Connection(asyncio.Protocol):
    def __init__(self, client: H2Client) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.decoder = BlockDecoder(1 << 20)
        self.calls: dict[int, _Call] = {}
        self.next_stream = 1
        self.send_window = 65535
        self.peer_window = 65535
        self.peer_frame = 16384
        self.received = 0
        self.closed: str | None = None
        self.block: bytearray | None = None
        self.block_stream = 0
        self.block_ends = False
        self.out: list[bytes] = []
        """Frames written this turn of the loop (``_write``)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        settings = b"".join(
            k.to_bytes(2, "big") + v.to_bytes(4, "big")
            for k, v in (
                (_ENABLE_PUSH, 0),
                (S_INITIAL_WINDOW_SIZE, MAX_WINDOW),
                (S_MAX_FRAME_SIZE, _RECEIVE_FRAME),
            )
        )
        self.transport.write(
            PREFACE
            + frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(f"the connection closed{f': {exc}' if exc else ''}")

    def _end(self, why: str) -> None:
        """No more calls on this connection; those in flight fail, saying they were sent."""
        self.closed = self.closed or why
        if self.client.connection is self:
            self.client.connection = None
        calls, self.calls = self.calls, {}
        for call in calls.values():
            if not call.done.done():
                call.done.set_result((UNAVAILABLE, f"{why} with the call sent", b""))
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    # calls out
    def _write(self, data: bytes) -> None:
        """Frames out: those written in one turn of the loop go in one system call."""
        if not self.out:
            self.client.loop.call_soon(self._write_out)
        self.out.append(data)

    def _write_out(self) -> None:
        data, self.out = b"".join(self.out), []
        if self.transport is not None:
            self.transport.write(data)

    def start(self, block: bytes, body: bytes, done: asyncio.Future[H2Call]) -> int:
        sid = self.next_stream
        self.next_stream += 2
        if self.next_stream >= _LAST_STREAM:  # stream ids spent: the next call reconnects
            self.client.connection = None
        call = self.calls[sid] = _Call(done, body, self.peer_window)
        self._write(frame(HEADERS, END_HEADERS, sid, block))
        self._send(sid, call)
        return sid

    def cancel(self, sid: int) -> None:
        if self.calls.pop(sid, None) is not None:
            self._write(frame(RST_STREAM, 0, sid, CANCEL.to_bytes(4, "big")))

    def _send(self, sid: int, call: _Call) -> None:
        """As much of the call's message as the windows allow, the last frame ending it."""
        out, sent = call.out, 0
        while sent < len(out):
            n = min(len(out) - sent, self.peer_frame, self.send_window, call.send_window)
            if n <= 0:
                break
            last = sent + n == len(out)
            self._write(frame(DATA, END_STREAM if last else 0, sid, out[sent : sent + n]))
            sent += n
            self.send_window -= n
            call.send_window -= n
        call.out = out[sent:]
        if not call.out:
            call.send_window = -1  # all sent

    def _flush(self) -> None:
        for sid, call in list(self.calls.items()):
            if call.send_window >= 0 and self.send_window > 0:
                self._send(sid, call)

    # frames in
    def data_received(self, data: bytes) -> None:
        self.buffer += data
        buf, pos = self.buffer, 0
        try:
            while (whole := next_frame(buf, pos)) is not None:
                kind, flags, sid, payload, pos = whole
                self._frame(kind, flags, sid, payload)
        except (hpack.HPACKError, ValueError) as exc:
            self._end(f"the server's HTTP/2 is malformed ({exc})")
            return
        del buf[:pos]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == DATA:
            self.received += len(payload)
            if self.received >= 1 << 24:  # open the window again
                self._write(frame(WINDOW_UPDATE, 0, 0, self.received.to_bytes(4, "big")))
                self.received = 0
            call = self.calls.get(sid)
            if call is not None:
                call.body += _unpadded(flags, payload)
                if flags & END_STREAM:
                    self._finish(sid, call)
        elif kind == HEADERS:
            payload = _unpadded(flags, payload)
            self.block = bytearray(payload[5:] if flags & PRIORITY_FLAG else payload)
            self.block_stream, self.block_ends = sid, bool(flags & END_STREAM)
            if flags & END_HEADERS:
                self._headers()
        elif kind == CONTINUATION and self.block is not None:
            self.block += payload
            if flags & END_HEADERS:
                self._headers()
        elif kind == SETTINGS and not flags & ACK:
            self._settings(payload)
        elif kind == WINDOW_UPDATE and len(payload) == 4:
            increment = int.from_bytes(payload, "big") & MAX_WINDOW
            if sid == 0:
                self.send_window += increment
            elif sid in self.calls:
                self.calls[sid].send_window += increment
            self._flush()
        elif kind == PING and not flags & ACK:
            self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            call = self.calls.pop(sid, None)
            if call is not None and not call.done.done():
                code = int.from_bytes(payload, "big")
                call.done.set_result((UNAVAILABLE, f"the server reset the call (code {code})", b""))
        elif kind == GOAWAY:
            last = int.from_bytes(payload[:4], "big") & MAX_WINDOW
            if self.client.connection is self:  # new calls go to a new connection
                self.client.connection = None
            for late in [s for s in self.calls if s > last]:  # never processed: safe again
                call = self.calls.pop(late)
                if not call.done.done():
                    call.done.set_result((UNAVAILABLE, "the server is going away", b""))
            self.closed = "the server sent GOAWAY"
            if not self.calls:
                self._end(self.closed)

    def _headers(self) -> None:
        """A whole header block: decoded even for a call given up (HPACK's state is shared)."""
        assert self.block is not None
        headers = self.decoder.decode(bytes(self.block))
        self.block = None
        call = self.calls.get(self.block_stream)
        if call is not None:
            call.headers.update(headers)
            if self.block_ends:
                self._finish(self.block_stream, call)

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                for call in self.calls.values():
                    if call.send_window >= 0:
                        call.send_window += value - self.peer_window
                self.peer_window = value
            elif key == S_MAX_FRAME_SIZE:
                self.peer_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._flush()

    def _finish(self, sid: int, call: _Call) -> None:
        self.calls.pop(sid, None)
        if call.done.done():
            return
        headers = call.headers
        status = headers.get(b":status", b"200")
        if status != b"200":
            call.done.set_result((UNAVAILABLE, f"HTTP status {status.decode()}", b""))
        else:
            code = int(headers.get(b"grpc-status", b"2"))
            message = urllib.parse.unquote(headers.get(b"grpc-message", b"").decode())
            body = bytes(call.body)
            if code == 0 and (len(body) < 5 or body[0]):
                code, message = INTERNAL, "the reply is not one uncompressed gRPC message"
            call.done.set_result((code, message, body[5:] if code == 0 else b""))
        if self.closed and not self.calls:
            self._end(self.closed)


def _unpadded(flags: int, payload: bytes) -> bytes:
    if flags & PADDED and payload:
        return payload[1 : len(payload) - payload[0]]
    return payload


class H2Client:
    """Unary gRPC calls to ``host:port`` over one HTTP/2 connection (made on first use,
    on the running loop, and again after it closes)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.connection: _Connection | None = None
        self._blocks: dict[tuple[str, Sequence[tuple[str, Any]]], bytes] = {}
        self._connecting: asyncio.Future[_Connection] | None = None
        self.loop: asyncio.AbstractEventLoop

    def _block(self, path: str, metadata: Sequence[tuple[str, Any]]) -> bytes:
        """The call's request headers, as literals (no HPACK state), kept per call shape."""
        key = (path, tuple(metadata))
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= 256:
                self._blocks.clear()
            fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                      (b":authority", f"{self.host}:{self.port}".encode()),
                      (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip
            fields += [
                (k.encode(), v if isinstance(v, bytes) else str(v).encode()) for k, v in metadata
            ]
            block = self._blocks[key] = b"".join(literal(k, v) for k, v in fields)
        return block

    async def _connect(self) -> _Connection:
        self.loop = asyncio.get_running_loop()
        _, connection = await self.loop.create_connection(
            lambda: _Connection(self), self.host, self.port
        )
        return connection

    async def call(
        self, path: str, message: bytes, metadata: Sequence[tuple[str, Any]] = ()
    ) -> H2Call:
        """``message`` to method ``path``: (code, message, reply bytes). A call that could
        not be sent ends UNAVAILABLE saying "failed to connect"."""
        connection = self.connection
        if connection is None:
            if self._connecting is None:  # one connection however many calls wait for it
                self._connecting = asyncio.ensure_future(self._connect())
            connecting = self._connecting
            try:
                connection = await asyncio.shield(connecting)
            except OSError as exc:
                return UNAVAILABLE, f"failed to connect to {self.host}:{self.port}: {exc}", b""
            finally:
                if self._connecting is connecting and connecting.done():
                    self._connecting = None
            if connection.closed is None and self.connection is None:
                self.connection = connection
        if connection.closed is not None:  # closed before this call could be sent
            return (
                UNAVAILABLE,
                f"failed to connect to {self.host}:{self.port}: {connection.closed}",
                b"",
            )
        done: asyncio.Future[H2Call] = self.loop.create_future()
        body = b"\x00" + len(message).to_bytes(4, "big") + message
        sid = connection.start(self._block(path, metadata), body, done)
        try:
            return await done
        except asyncio.CancelledError:
            connection.cancel(sid)
            raise

    async def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection._end("the client closed")
