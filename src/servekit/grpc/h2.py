"""servekit's own gRPC server: unary and bidirectional-streaming calls over HTTP/2 (h2c)
on an asyncio Protocol.

grpc.aio spends about twice the native runtime's whole HTTP path on each call (its
Cython core drives every call through the event loop); this server reads frames
itself, decodes headers with ``hpack`` and hands each call's message to the same
servicer methods ``grpc.aio`` would call, with a context that offers what they use
(``abort``, ``invocation_metadata``, ``set_code``/``set_details``; ``grpc.calls``). A
call is one task; the frames a connection writes in one turn of the loop (every answer
of a batch) go out in one system call.

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
waits), 100 concurrent calls per connection (REFUSED_STREAM beyond), a 64 KiB header
block. A connection that breaks HTTP/2 itself (bad preface, frame or header block) gets
GOAWAY and is closed; every other connection and call goes on.

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
from collections.abc import AsyncGenerator, Mapping
from typing import Any, cast

import hpack
from google.protobuf.message import DecodeError

from .calls import Aborted, CallContext, Method, deadline, inflated, unary_message
from .frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEADLINE_EXCEEDED,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INDEXED,
    INTERNAL,
    INTERNAL_ERROR,
    INVALID_ARGUMENT,
    MAX_WINDOW,
    NO_ERROR,
    OK,
    OK_TRAILERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTINGS,
    STREAM_CLOSED,
    UNIMPLEMENTED,
    UNKNOWN,
    WINDOW_UPDATE,
    frame,
    frame_length,
    next_frame,
    status_block,
)

__all__ = ["GrpcH2Server"]

log = logging.getLogger(__name__)

MAX_STREAMS = 100
MAX_FRAME = 1 << 20
"""The largest frame this server takes (advertised); it sends at most the peer's."""
MAX_HEADER_BLOCK = 64 * 1024
FRAMES_PER_TURN = 256
"""Frames of one connection handled per turn of the loop before the others get theirs."""
RESETS = (1000, 100.0)
"""Streams a peer may reset: a burst, then so many a second (a client cancelling calls
stays far below; a rapid-reset attack runs at tens of thousands)."""
STREAM_BACKLOG = 1 << 20
"""Bytes of whole messages a streaming call may leave untaken before its connection stops
being read (one message of any size is always taken in)."""
CONTROL = (1000, 100.0)
"""PING, SETTINGS and empty DATA frames a peer may send: a burst, then so many a second."""


class _Budget:
    """A token bucket: ``take()`` is False once the peer has spent more than it earns."""

    def __init__(self, burst: int, rate: float, clock: Any) -> None:
        self.burst, self.rate, self.clock = burst, rate, clock
        self.tokens, self.at = float(burst), clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= 1
        return self.tokens >= 0


class BlockDecoder:
    """HPACK decoding for one connection. A block of indexed fields only reads the tables
    without changing them, so it means the same until a block that may change them: a
    peer repeating its headers sends the same few bytes each time, decoded once."""

    def __init__(self, max_header_list_size: int = MAX_HEADER_BLOCK) -> None:
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = max_header_list_size
        self.decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The block's headers (raw bytes); ``hpack.HPACKError`` if it is malformed."""
        headers = self.decoded.get(block)
        if headers is not None:
            return headers
        headers = cast(list[tuple[bytes, bytes]], self.decoder.decode(block, raw=True))
        if block.translate(None, INDEXED) or len(self.decoded) >= 64:
            self.decoded.clear()
        else:
            self.decoded[block] = headers
        return headers


class _Stream:
    __slots__ = (
        "chunks",
        "drained",
        "ended",
        "headers",
        "inbox",
        "out",
        "send_window",
        "sent_headers",
        "size",
        "task",
        "timer",
        "trailers",
    )

    def __init__(self, send_window: int) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        """Request bytes held: arriving (unary), or not yet taken by the method (streaming)."""
        self.send_window = send_window
        self.out = b""
        """Message bytes (framed) waiting for flow-control window."""
        self.trailers = b""
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.inbox: asyncio.Queue[tuple[int, bytes] | None] | None = None
        """A streaming call's whole request messages (compressed flag, bytes), None at the end."""
        self.ended = False
        self.sent_headers = False
        self.drained: asyncio.Event | None = None
        """Set once ``out`` is short again: a streaming call waits on it before its next message."""


class _Connection(asyncio.Protocol):
    """One client connection: frames in, calls out, answers back."""

    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.out: list[bytes] = []
        """Frames written this turn of the loop: sent together, one system call for all."""
        self.preface = False
        self.decoder = BlockDecoder()
        self.streams: dict[int, _Stream] = {}
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
        self.resets = _Budget(server.resets[0], server.resets[1], clock)
        self.control = _Budget(server.control[0], server.control[1], clock)
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
            _cancel(stream)
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
        except _ConnectionError as exc:
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

    def _write(self, data: bytes) -> None:
        if not self.out:
            self.server.loop.call_soon(self._send_out)
        self.out.append(data)

    def _send_out(self) -> None:
        if self.out and self.transport is not None and not self.hanging_up:
            self.transport.write(b"".join(self.out))
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

    # frames
    def _frames(self) -> bool:
        """Handle the whole frames buffered, up to ``FRAMES_PER_TURN``; whether more wait."""
        buf = self.buffer
        pos = 0
        handled = 0
        if not self.preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return False
            if buf[: len(PREFACE)] != PREFACE:
                raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self.preface = True
            pos = len(PREFACE)
        end = len(buf)
        while end - pos >= 9 and self.transport is not None:
            if "inbox" in self.paused:  # taken up again once the streams take their messages
                break
            if handled == FRAMES_PER_TURN:
                del buf[:pos]
                return True
            handled += 1
            length = frame_length(buf, pos) or 0
            if length > MAX_FRAME:
                raise _ConnectionError(
                    FRAME_SIZE_ERROR, f"frame of {length} bytes; the limit is {MAX_FRAME}"
                )
            whole = next_frame(buf, pos)
            if whole is None:
                break
            kind, flags, stream, payload, pos = whole
            self._frame(kind, flags, stream, payload)
        del buf[:pos]
        return False

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.block is not None and (kind != CONTINUATION or sid != self.block_stream):
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if self.block is None:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._block(payload, flags)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._spend(self.control, "SETTINGS")
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid != 0 or len(payload) != 8:
                raise _ConnectionError(PROTOCOL_ERROR, "PING must be 8 bytes on stream 0")
            if not flags & ACK:
                self._spend(self.control, "PING")
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise _ConnectionError(PROTOCOL_ERROR, "malformed RST_STREAM")
            self._spend(self.resets, "RST_STREAM")
            stream = self.streams.pop(sid, None)
            if stream is not None:
                self._release(stream)
                _cancel(stream)
        elif kind == GOAWAY:
            self.going_away = True
            if not self.streams:
                self.close()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "clients may not push")
        elif kind == PRIORITY and len(payload) != 5:
            raise _ConnectionError(FRAME_SIZE_ERROR, "PRIORITY must be 5 bytes")
        # PRIORITY (advice only) and unknown frame types are ignored, as RFC 9113 asks.

    def _spend(self, budget: _Budget, what: str) -> None:
        if not budget.take():
            raise _ConnectionError(ENHANCE_YOUR_CALM, f"too many {what} frames")

    def _strip_padding(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise _ConnectionError(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        payload = self._strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if sid in self.streams:  # trailers of a request (gRPC clients send none): its end
            if self.streams[sid].task is not None and self.streams[sid].inbox is None:
                raise _ConnectionError(STREAM_CLOSED, f"HEADERS after END_STREAM on stream {sid}")
            if not flags & END_STREAM:
                raise _ConnectionError(PROTOCOL_ERROR, "HEADERS again without END_STREAM")
        elif sid <= self.last_stream:
            raise _ConnectionError(STREAM_CLOSED, f"HEADERS on closed stream {sid}")
        self.block = bytearray()
        self.block_stream, self.block_ends = sid, bool(flags & END_STREAM)
        self._block(payload, flags)

    def _block(self, payload: bytes, flags: int) -> None:
        assert self.block is not None
        self.block += payload
        if len(self.block) > MAX_HEADER_BLOCK:
            raise _ConnectionError(PROTOCOL_ERROR, f"header block over {MAX_HEADER_BLOCK} bytes")
        if not flags & END_HEADERS:
            return
        block, sid, ends = bytes(self.block), self.block_stream, self.block_ends
        self.block = None
        headers = self._decode(block)
        stream = self.streams.get(sid)
        if stream is None:
            self.last_stream = sid
            if self.going_away or len(self.streams) >= MAX_STREAMS:
                self._write(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
                return
            stream = self.streams[sid] = _Stream(self.peer_window)
            stream.headers = headers
            method = self.server.methods.get(dict(headers).get(b":path", b""))
            if method is not None and method.streaming:
                self._open(sid, stream, method)
                if self.streams.get(sid) is not stream:
                    return  # refused
        if stream.inbox is not None:
            if ends:
                self._stream_data(sid, stream, b"", True)
        elif ends:
            self._dispatch(sid, stream)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self.decoder.decode(block)
        except hpack.HPACKError as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"header block: {exc}") from None

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        if not payload and not flags & END_STREAM:
            self._spend(self.control, "empty DATA")
        self.recv_window -= len(payload)
        if self.recv_window < MAX_WINDOW // 2:
            self._write(
                frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - self.recv_window).to_bytes(4, "big"))
            )
            self.recv_window = MAX_WINDOW
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream already answered or reset: its data is dropped
        if stream.inbox is not None:
            self._stream_data(sid, stream, self._strip_padding(flags, payload), flags & END_STREAM)
            return
        if stream.task is not None:
            raise _ConnectionError(STREAM_CLOSED, f"DATA after END_STREAM on stream {sid}")
        data = self._strip_padding(flags, payload)
        stream.size += len(data)
        self.buffered += len(data)
        limit = self.server.max_message_bytes
        if stream.size > limit + 5:
            self._drop(sid, stream, f"request message larger than the limit of {limit} bytes")
            return
        if self.buffered > 2 * limit + 10:
            self._drop(
                sid,
                stream,
                f"unfinished requests on this connection hold over {2 * limit} bytes",
            )
            return
        stream.chunks.append(data)
        if flags & END_STREAM:
            self._dispatch(sid, stream)

    def _drop(self, sid: int, stream: _Stream, why: str) -> None:
        """Refuse a request still arriving: RESOURCE_EXHAUSTED; the rest of it is dropped."""
        self._release(stream)
        self._answer(sid, stream, RESOURCE_EXHAUSTED, why, reset=True)

    def _release(self, stream: _Stream) -> None:
        self.buffered -= stream.size
        stream.size = 0
        stream.chunks = []
        self._taken(None, 0)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                for stream in self.streams.values():
                    stream.send_window += value - self.peer_window
                self.peer_window = value
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value < 1 << 24:
                    raise _ConnectionError(PROTOCOL_ERROR, f"max frame size {value}")
                self.peer_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._flush()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if sid == 0:
            if increment == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
        else:
            stream = self.streams.get(sid)
            if stream is None:
                return
            stream.send_window += increment
            if increment == 0 or stream.send_window > MAX_WINDOW:
                self.streams.pop(sid)
                _cancel(stream)
                code = PROTOCOL_ERROR if increment == 0 else FLOW_CONTROL_ERROR
                self._write(frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))
                return
        self._flush()

    # calls
    def _dispatch(self, sid: int, stream: _Stream) -> None:
        """The request has ended: check what the headers ask, then run the call."""
        data = b"".join(stream.chunks)
        self._release(stream)
        headers = dict(stream.headers)
        if headers.get(b":method") != b"POST":
            self._answer(sid, stream, UNIMPLEMENTED, "gRPC calls are POST requests")
            return
        if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            self._answer(sid, stream, UNKNOWN, "content-type must be application/grpc")
            return
        path = headers.get(b":path", b"")
        if path not in self.server.methods:
            self._answer(
                sid, stream, UNIMPLEMENTED, f"unknown method {path.decode(errors='replace')}"
            )
            return
        method = self.server.methods[path]
        if method is None:
            name = path.rsplit(b"/", 1)[-1].decode()
            self._answer(sid, stream, UNIMPLEMENTED, f"{name}: streaming calls are not served")
            return
        try:
            message = unary_message(
                data,
                headers.get(b"grpc-encoding"),
                self.server.max_message_bytes,
            )
            timeout = deadline(headers.get(b"grpc-timeout"))
        except Aborted as exc:
            self._answer(sid, stream, exc.code, exc.details)
            return
        task = self.server.loop.create_task(self._call(sid, stream, method, message))
        stream.task = task
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)
        if timeout is not None:
            stream.timer = self.server.loop.call_later(timeout, self._expire, sid, stream)

    # streaming calls
    def _open(self, sid: int, stream: _Stream, method: Method) -> None:
        """A streaming call starts with its headers; its messages follow as they come."""
        headers = dict(stream.headers)
        if headers.get(b":method") != b"POST":
            self._answer(sid, stream, UNIMPLEMENTED, "gRPC calls are POST requests")
            return
        if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            self._answer(sid, stream, UNKNOWN, "content-type must be application/grpc")
            return
        try:
            timeout = deadline(headers.get(b"grpc-timeout"))
        except Aborted as exc:
            self._answer(sid, stream, exc.code, exc.details)
            return
        stream.inbox = asyncio.Queue()
        task = self.server.loop.create_task(
            self._stream_call(sid, stream, method, headers.get(b"grpc-encoding"))
        )
        stream.task = task
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)
        if timeout is not None:
            stream.timer = self.server.loop.call_later(timeout, self._expire, sid, stream)

    def _stream_data(self, sid: int, stream: _Stream, data: bytes, end: int | bool) -> None:
        """Whole messages to the call's inbox. Past twice the message limit held on this
        connection, frames wait unread (and the socket with them) until the calls take
        their messages: a client sending faster than its calls are answered is paused."""
        assert stream.inbox is not None and stream.task is not None
        if stream.ended:
            raise _ConnectionError(STREAM_CLOSED, f"DATA after END_STREAM on stream {sid}")
        limit = self.server.max_message_bytes
        pending = stream.chunks[0] + data if stream.chunks else data
        start = 0
        while len(pending) - start >= 5:
            length = int.from_bytes(pending[start + 1 : start + 5], "big")
            if length > limit:
                stream.task.cancel()
                why = f"request message larger than the limit of {limit} bytes"
                self._finish(sid, stream, RESOURCE_EXHAUSTED, why, reset=True)
                return
            if len(pending) - start < 5 + length:
                break
            stream.inbox.put_nowait((pending[start], pending[start + 5 : start + 5 + length]))
            start += 5 + length
        stream.chunks = [pending[start:]] if start < len(pending) else []
        stream.size += len(data)
        self.buffered += len(data)
        if end:
            stream.ended = True
            if stream.chunks:
                stream.task.cancel()
                self._finish(sid, stream, INVALID_ARGUMENT, "the stream ended inside a message")
                return
            stream.inbox.put_nowait(None)
        if self.buffered > 2 * limit or (stream.inbox.qsize() > 1 and stream.size > STREAM_BACKLOG):
            self._pause("inbox")

    def _taken(self, stream: _Stream | None, size: int) -> None:
        """A call took ``size`` bytes of its messages: frames held back may be read again."""
        if stream is not None:
            stream.size -= size
            self.buffered -= size
        if (
            "inbox" in self.paused
            and self.buffered <= self.server.max_message_bytes
            and (stream is None or stream.size <= STREAM_BACKLOG)
        ):
            self._resume("inbox")
            self.server.loop.call_soon(self._turn)

    async def _requests(
        self, stream: _Stream, method: Method, encoding: bytes | None
    ) -> AsyncGenerator[Any, None]:
        inbox = stream.inbox
        assert inbox is not None
        while (item := await inbox.get()) is not None:
            compressed, payload = item
            self._taken(stream, 5 + len(payload))
            message = inflated(bool(compressed), payload, encoding, self.server.max_message_bytes)
            try:
                request = method.request_type.FromString(message)
            except DecodeError:
                kind = method.request_type.__name__
                raise Aborted(
                    INVALID_ARGUMENT, f"{method.name}: a message is not a {kind}"
                ) from None
            yield request

    async def _stream_call(
        self, sid: int, stream: _Stream, method: Method, encoding: bytes | None
    ) -> None:
        """Run the method over the stream's requests; each response goes out as it comes,
        and the method waits while the peer leaves more than ``max_unsent_bytes`` unread.
        Cancelled (reset, deadline, connection lost), the method's generator is closed."""
        context = CallContext(stream.headers)
        requests = self._requests(stream, method, encoding)
        try:
            async with contextlib.aclosing(method.handler(requests, context)) as responses:
                async for response in responses:
                    if self.streams.get(sid) is not stream:
                        return
                    body = response.SerializeToString()
                    if not stream.sent_headers:
                        self._write(frame(HEADERS, END_HEADERS, sid, RESPONSE_HEADERS))
                        stream.sent_headers = True
                    stream.out += b"\x00" + len(body).to_bytes(4, "big") + body
                    self._send(sid, stream)
                    if len(stream.out) > self.server.max_unsent_bytes:
                        stream.drained = asyncio.Event()
                        await stream.drained.wait()
                        stream.drained = None
        except Aborted as exc:
            self._finish(sid, stream, exc.code, exc.details)
            return
        except asyncio.CancelledError:
            return  # reset by the client or past its deadline: answered already, or nobody asks
        except Exception as exc:
            log.exception("unexpected error in gRPC call %s", method.name)
            self._finish(sid, stream, INTERNAL, f"internal error: {type(exc).__name__}")
            return
        finally:
            await requests.aclose()
        self._finish(sid, stream, OK, "")

    def _finish(
        self, sid: int, stream: _Stream, code: int, message: str, *, reset: bool = False
    ) -> None:
        """End a call with its status: trailers after what it sent, or alone."""
        if self.streams.get(sid) is not stream:
            return
        if not stream.sent_headers:
            reset = reset or (stream.inbox is not None and not stream.ended)
            self._answer(sid, stream, code, message, reset=reset)
            return
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        stream.trailers = OK_TRAILERS if code == OK else status_block(code, message)
        self._send(sid, stream)

    def _expire(self, sid: int, stream: _Stream) -> None:
        if self.streams.get(sid) is stream and stream.task is not None:
            stream.timer = None
            stream.task.cancel()
            self._finish(sid, stream, DEADLINE_EXCEEDED, "deadline exceeded")

    async def _call(self, sid: int, stream: _Stream, method: Method, message: bytes) -> None:
        context = CallContext(stream.headers)
        try:
            request = method.request_type.FromString(message)
        except DecodeError:
            self._answer(
                sid,
                stream,
                INVALID_ARGUMENT,
                f"{method.name}: the request is not a {method.request_type.__name__} message",
            )
            return
        try:
            response = await method.handler(request, context)
        except Aborted as exc:
            self._answer(sid, stream, exc.code, exc.details)
            return
        except NotImplementedError:
            self._answer(
                sid, stream, context.status[0] or UNIMPLEMENTED, context.status[1] or method.name
            )
            return
        except asyncio.CancelledError:
            return  # reset by the client or past its deadline: answered already, or nobody asks
        except Exception as exc:
            log.exception("unexpected error in gRPC call %s", method.name)
            self._answer(sid, stream, INTERNAL, f"internal error: {type(exc).__name__}")
            return
        body = response.SerializeToString()
        self._answer(sid, stream, OK, "", b"\x00" + len(body).to_bytes(4, "big") + body)

    def _answer(
        self,
        sid: int,
        stream: _Stream,
        code: int,
        message: str,
        body: bytes = b"",
        *,
        reset: bool = False,
    ) -> None:
        """Headers, the message (if any) and the trailers; one write when the windows allow."""
        if self.streams.get(sid) is not stream:
            return  # reset, expired or the connection is gone
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if not body:
            block = RESPONSE_HEADERS + status_block(code, message)
            tail = frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big")) if reset else b""
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, sid, block) + tail)
            self._close(sid)
            return
        self._write(frame(HEADERS, END_HEADERS, sid, RESPONSE_HEADERS))
        stream.out = body
        stream.trailers = OK_TRAILERS if code == OK else status_block(code, message)
        self._send(sid, stream)

    def _send(self, sid: int, stream: _Stream) -> None:
        """As much of the stream's message as the windows allow, then (all sent) its trailers."""
        out = stream.out
        frames: list[bytes] = []
        sent = 0
        while sent < len(out):
            n = min(len(out) - sent, self.peer_frame, self.send_window, stream.send_window)
            if n <= 0:
                break
            frames.append(frame(DATA, 0, sid, out[sent : sent + n]))
            sent += n
            self.send_window -= n
            stream.send_window -= n
        stream.out = out[sent:]
        done = not stream.out and stream.trailers
        if done:
            frames.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, stream.trailers))
            if stream.inbox is not None and not stream.ended:  # the client may stop sending
                frames.append(frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big")))
        self._write(b"".join(frames))
        if done:
            self._close(sid)
        elif stream.drained is not None and len(stream.out) <= self.server.max_unsent_bytes:
            stream.drained.set()

    def _flush(self) -> None:
        for sid, stream in list(self.streams.items()):
            if stream.out and self.send_window > 0:
                self._send(sid, stream)

    def _close(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is not None and stream.size:
            self._release(stream)
        if self.going_away and not self.streams:
            self.close()


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _cancel(stream: _Stream) -> None:
    if stream.timer is not None:
        stream.timer.cancel()
    if stream.task is not None:
        stream.task.cancel()


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
