"""servekit's own gRPC server: unary and bidirectional-streaming calls over HTTP/2 (h2c)
on an asyncio Protocol.

grpc.aio spends about twice the native runtime's whole HTTP path on each call (its
Cython core drives every call through the event loop); this server reads frames
itself, decodes headers with ``hpack`` and hands each call's message to the same
servicer methods ``grpc.aio`` would call, with a context that offers what they use
(``abort``, ``invocation_metadata``, ``set_code``/``set_details``; ``grpc.calls``). A
call is one task; the frames a connection writes in one turn of the loop (every answer
of a batch) go out in one system call. This module is the server and each connection's
life (budgets, pauses, writes, GOAWAY); its frames are read in ``h2frames`` and its
calls answered in ``h2calls``.

What it serves: unary methods of a protobuf service, and bidirectional ones the servicer
writes as async generators (a stream's requests reach it as they arrive, its responses
go out as it yields them; other streaming methods answer UNIMPLEMENTED), identity, gzip
or deflate messages, ``grpc-timeout`` (DEADLINE_EXCEEDED), RST_STREAM (the call is
cancelled, a stream's generator closed), flow control both ways, PING, GOAWAY on stop
(calls in flight are answered first). Limits: ``max_message_bytes`` per request message
(RESOURCE_EXHAUSTED; the rest of the stream is dropped, never buffered), twice that for
all the requests still arriving or not yet taken on one connection (a unary request past
it is refused; a stream's messages past it, or past ``STREAM_BACKLOG`` untaken on one
stream, leave the socket unread until the calls take them), ``max_unsent_bytes`` of a stream's responses the peer has not read (its generator
waits), 100 concurrent calls per connection (REFUSED_STREAM beyond), 64 KiB of headers
per call (RESOURCE_EXHAUSTED; the block is still decoded, so the connection goes on).
A connection that breaks HTTP/2 itself (bad preface, frame or header block, or a header
block over 1 MiB) gets GOAWAY and is closed; every other connection and call goes on.

Against a peer that means harm (the known HTTP/2 denial-of-service classes), as nghttp2
and grpc-core do: a budget per connection of streams the peer resets (rapid reset,
CVE-2023-44487) and of control frames it makes the server answer or do (PING,
SETTINGS, empty DATA), past which it gets GOAWAY ENHANCE_YOUR_CALM; reading paused while
the replies a peer does not read exceed ``max_unsent_bytes``; at most ``FRAMES_PER_TURN``
frames of one connection per turn of the loop, so a flood on one cannot hold the others;
a preface deadline, an idle timeout and a cap on connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import cast

from .calls import Method
from .frames import (
    ENHANCE_YOUR_CALM,
    GOAWAY,
    INTERNAL_ERROR,
    MAX_WINDOW,
    NO_ERROR,
    PROTOCOL_ERROR,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from .h2calls import H2Error, Stream, cancel
from .h2frames import MAX_FRAME, MAX_HEADER_BLOCK, MAX_STREAMS, BlockDecoder, Budget, Frames

__all__ = ["GrpcH2Server"]

LARGE_WRITE = 64 << 10
"""A write at least this large goes to the socket as it is rather than joined with others."""

log = logging.getLogger(__name__)

RESETS = (2000, 1000.0)
"""Streams a peer may reset: a burst, then so many a second. Clients with deadlines under
overload cancel hundreds a second on one connection (64 bench clients with a 100 ms
deadline: about 600); a rapid-reset attack runs at tens of thousands."""
CONTROL = (1000, 100.0)
"""PING, SETTINGS and empty DATA frames a peer may send: a burst, then so many a second."""


class _Connection(Frames, asyncio.Protocol):
    """One client connection: frames in, calls out, answers back."""

    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.out: list[bytes | memoryview] = []
        """Frames written this turn of the loop: sent together, one system call for all."""
        self.preface = False
        self.decoder = BlockDecoder()
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.block: bytearray | None = None
        self.block_stream = 0
        self.block_ends = False
        self.send_window = 65535
        self.peer_window = 65535
        self.peer_frame = 16384
        self.recv_window = MAX_WINDOW
        self.buffered = 0
        """Bytes of requests still arriving, on all streams (twice the message limit at most)."""
        self.going_away = False
        self.hanging_up = False
        clock = server.loop.time
        self.resets = Budget(server.resets[0], server.resets[1], clock)
        self.control = Budget(server.control[0], server.control[1], clock)
        self.paused: set[str] = set()
        """Why reading is paused: "writes" (the peer does not read), "turn" (its share of
        the loop is spent for now), "inbox" (a stream's messages wait to be taken; frames
        stay unhandled), "buffer" (more than a frame read and not yet handled)."""
        self.active = clock()
        self.timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.server.max_connections:
            self.goaway(ENHANCE_YOUR_CALM, "too many connections")
            return
        self.server.connections.add(self)
        cast(asyncio.WriteTransport, transport).set_write_buffer_limits(
            high=self.server.max_unsent_bytes
        )
        self.timer = self.server.loop.call_later(self.server.handshake_timeout_s, self._tick)
        settings = b"".join(
            key.to_bytes(2, "big") + value.to_bytes(4, "big")
            for key, value in (
                (S_MAX_CONCURRENT_STREAMS, MAX_STREAMS),
                (S_INITIAL_WINDOW_SIZE, MAX_WINDOW),
                (S_MAX_FRAME_SIZE, MAX_FRAME),
                (S_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK),
            )
        )
        self._write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65535).to_bytes(4, "big"))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
        for stream in self.streams.values():
            cancel(stream)
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        if self.hanging_up:
            return
        self.buffer += data
        self.active = self.server.loop.time()
        self._turn()

    def _turn(self) -> None:
        """Handle up to ``FRAMES_PER_TURN`` frames; with more waiting, stop reading and
        come back on the next turn of the loop, after the other connections."""
        self._resume("turn")
        try:
            more = self._frames()
        except H2Error as exc:
            self.goaway(exc.code, str(exc))
            return
        except Exception:  # a bug here closes this connection only, never the server
            log.exception("gRPC connection failed")
            self.goaway(INTERNAL_ERROR, "internal error")
            return
        if self.transport is None or self.hanging_up:
            return
        if len(self.buffer) > MAX_FRAME + 9:  # frames held back: read no more until handled
            self._pause("buffer")
        else:
            self._resume("buffer")
        if more:
            self._pause("turn")
            self.server.loop.call_soon(self._turn)

    def _pause(self, why: str) -> None:
        if not self.paused and self.transport is not None:
            self.transport.pause_reading()
        self.paused.add(why)

    def _resume(self, why: str) -> None:
        if why in self.paused:
            self.paused.discard(why)
            if not self.paused and self.transport is not None:
                self.transport.resume_reading()

    def pause_writing(self) -> None:  # the peer leaves our replies unread
        self._pause("writes")

    def resume_writing(self) -> None:
        self._resume("writes")

    def _tick(self) -> None:
        """The preface deadline, then the idle timeout: a connection with no call in flight
        and no frame for ``idle_timeout_s`` is told GOAWAY and closed."""
        server = self.server
        if self.transport is None:
            return
        if not self.preface:
            self.goaway(PROTOCOL_ERROR, "no HTTP/2 preface in time")
            return
        idle = server.loop.time() - self.active
        if not self.streams and idle >= server.idle_timeout_s:
            self.goaway(NO_ERROR, "idle")
            self.close()
            return
        wait = server.idle_timeout_s - idle if not self.streams else server.idle_timeout_s
        self.timer = server.loop.call_later(max(wait, 0.05), self._tick)

    def _write(self, *data: bytes | memoryview) -> None:
        if not self.out:
            self.server.loop.call_soon(self._send_out)
        self.out.extend(data)

    def _send_out(self) -> None:
        """This turn's writes: small ones joined into one write, a large payload (a
        message's view) written as it is, not copied to join it."""
        if self.out and self.transport is not None and not self.hanging_up:
            small: list[bytes | memoryview] = []
            for piece in self.out:
                if len(piece) < LARGE_WRITE:
                    small.append(piece)
                    continue
                if small:
                    self.transport.write(b"".join(small))
                    small = []
                self.transport.write(piece)
            if small:
                self.transport.write(b"".join(small))
        self.out.clear()

    def close(self) -> None:
        """Send what is written, then close."""
        self._send_out()
        if self.transport is not None:
            self.transport.close()

    def goaway(self, code: int, reason: str = "") -> None:
        """Tell the peer the last stream this connection took, then close it (on an error)
        or let the calls in flight finish (``NO_ERROR``, on stop)."""
        payload = self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big")
        self._write(frame(GOAWAY, 0, 0, payload + reason.encode()[:256]))
        self.going_away = True
        if code != NO_ERROR:
            self._hang_up()

    def _hang_up(self) -> None:
        """Send what is written and end our side, then drop what the peer still sends for
        a moment before closing: closing on unread input would reset the connection and
        the peer would never read the GOAWAY."""
        transport = self.transport
        if transport is None or self.hanging_up:
            return
        self._send_out()
        self.hanging_up = True
        if transport.can_write_eof():
            transport.write_eof()
        self._resume("turn")
        self._resume("writes")
        self.server.loop.call_later(1.0, self.close)


class GrpcH2Server:
    """Unary gRPC methods (``unary_methods``) on ``host:port``, on the running loop:
    ``await start()``, ``await stop(grace_s)`` (GOAWAY, answer what is in flight, close)."""

    def __init__(
        self,
        methods: Mapping[bytes, Method | None],
        host: str,
        port: int,
        max_message_bytes: int,
        *,
        handshake_timeout_s: float = 10.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = 1024,
        max_unsent_bytes: int = 1 << 20,
        resets: tuple[int, float] = RESETS,
        control: tuple[int, float] = CONTROL,
    ) -> None:
        self.methods, self.host, self.port = methods, host, port
        self.max_message_bytes = max_message_bytes
        self.handshake_timeout_s, self.idle_timeout_s = handshake_timeout_s, idle_timeout_s
        self.max_connections, self.max_unsent_bytes = max_connections, max_unsent_bytes
        self.resets, self.control = resets, control
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        self.loop: asyncio.AbstractEventLoop  # the loop start() runs on

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        host: str | None = None if self.host in ("0.0.0.0", "") else self.host
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, self.port, backlog=2048
        )

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            conn.goaway(NO_ERROR)
            if not conn.streams:
                conn.close()
        deadline = self.loop.time() + grace_s
        while self.tasks and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None
