"""How a connection of servekit's HTTP/2 server reads frames (``Frames``, a mixin of
``h2._Connection``): whole frames out of what it read, at most ``FRAMES_PER_TURN`` a turn;
HEADERS and CONTINUATION into header blocks (HPACK through ``BlockDecoder``), DATA into
the calls' messages under the connection's budgets, SETTINGS, WINDOW_UPDATE, PING,
RST_STREAM and GOAWAY; the peer's control frames and resets spent from token buckets
(``Budget``). A peer that breaks HTTP/2 raises ``H2Error``: its connection gets GOAWAY.
"""

from __future__ import annotations

from typing import Any, cast

import hpack

from .frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INDEXED,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RESOURCE_EXHAUSTED,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    frame,
    frame_length,
    next_frame,
)
from .h2calls import Calls, H2Error, Stream, cancel

__all__ = [
    "FRAMES_PER_TURN",
    "HEADER_BLOCK_CAP",
    "MAX_FRAME",
    "MAX_HEADER_BLOCK",
    "MAX_STREAMS",
    "BlockDecoder",
    "Budget",
    "Frames",
    "HeadersTooLarge",
]

MAX_STREAMS = 100
MAX_FRAME = 1 << 20
"""The largest frame this server takes (advertised); it sends at most the peer's."""
MAX_HEADER_BLOCK = 64 * 1024
"""The largest header list a call may send (advertised as SETTINGS_MAX_HEADER_LIST_SIZE,
counted as RFC 9113 does): a call past it is answered RESOURCE_EXHAUSTED, and the
connection, with the calls on it, goes on."""
HEADER_BLOCK_CAP = 1 << 20
"""The largest header block, as sent or decoded, a connection is read past (GOAWAY)."""
FRAMES_PER_TURN = 256
"""Frames of one connection handled per turn of the loop before the others get theirs."""


class Budget:
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


class HeadersTooLarge(Exception):
    """A header block decoded whole (the HPACK tables stay in step) to a list over the limit;
    the refusal names the largest header, the one to look at."""

    def __init__(self, size: int, limit: int, largest: tuple[bytes, bytes]) -> None:
        name, value = largest
        super().__init__(
            f"header list of {size} bytes exceeds the limit of {limit} bytes (the largest: "
            f"{name.decode(errors='replace')!r}, {len(name) + len(value)} bytes)"
        )
        self.size, self.limit = size, limit


class BlockDecoder:
    """HPACK decoding for one connection. A block of indexed fields only reads the tables
    without changing them, so it means the same until a block that may change them: a
    peer repeating its headers sends the same few bytes each time, decoded once."""

    def __init__(self, max_header_list_size: int = MAX_HEADER_BLOCK) -> None:
        self.decoder = hpack.Decoder()
        # Past the cap the decoder stops mid-block, its tables no longer the peer's.
        self.decoder.max_header_list_size = max(max_header_list_size, HEADER_BLOCK_CAP)
        self.limit = max_header_list_size
        self.decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The block's headers (raw bytes); ``hpack.HPACKError`` if it is malformed,
        ``HeadersTooLarge`` if they are over the limit but under the cap."""
        headers = self.decoded.get(block)
        if headers is not None:
            return headers
        headers = cast(list[tuple[bytes, bytes]], self.decoder.decode(block, raw=True))
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        if size > self.limit:
            largest = max(headers, key=lambda h: len(h[0]) + len(h[1]))
            raise HeadersTooLarge(size, self.limit, largest)
        if block.translate(None, INDEXED) or len(self.decoded) >= 64:
            self.decoded.clear()
        else:
            self.decoded[block] = headers
        return headers


class Frames(Calls):
    """The frames of one connection, handed to its calls (``Calls``)."""

    transport: Any
    buffer: bytearray
    preface: bool
    decoder: BlockDecoder
    last_stream: int
    block: bytearray | None
    block_stream: int
    block_ends: bool
    peer_window: int
    recv_window: int
    resets: Budget
    control: Budget

    def _frames(self) -> bool:
        """Handle the whole frames buffered, up to ``FRAMES_PER_TURN``; whether more wait."""
        buf = self.buffer
        pos = 0
        handled = 0
        if not self.preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return False
            if buf[: len(PREFACE)] != PREFACE:
                raise H2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
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
                raise H2Error(
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
            raise H2Error(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            if self.block is None:
                raise H2Error(PROTOCOL_ERROR, "CONTINUATION without HEADERS")
            self._block(payload, flags)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._spend(self.control, "SETTINGS")
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid != 0 or len(payload) != 8:
                raise H2Error(PROTOCOL_ERROR, "PING must be 8 bytes on stream 0")
            if not flags & ACK:
                self._spend(self.control, "PING")
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise H2Error(PROTOCOL_ERROR, "malformed RST_STREAM")
            self._spend(self.resets, "RST_STREAM")
            stream = self.streams.pop(sid, None)
            if stream is not None:
                self._release(stream)
                cancel(stream)
        elif kind == GOAWAY:
            self.going_away = True
            if not self.streams:
                self.close()
        elif kind == PUSH_PROMISE:
            raise H2Error(PROTOCOL_ERROR, "clients may not push")
        elif kind == PRIORITY and len(payload) != 5:
            raise H2Error(FRAME_SIZE_ERROR, "PRIORITY must be 5 bytes")
        # PRIORITY (advice only) and unknown frame types are ignored, as RFC 9113 asks.

    def _spend(self, budget: Budget, what: str) -> None:
        if not budget.take():
            raise H2Error(ENHANCE_YOUR_CALM, f"too many {what} frames")

    def _strip_padding(self, flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise H2Error(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise H2Error(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        payload = self._strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if sid in self.streams:  # trailers of a request (gRPC clients send none): its end
            if self.streams[sid].task is not None and self.streams[sid].inbox is None:
                raise H2Error(STREAM_CLOSED, f"HEADERS after END_STREAM on stream {sid}")
            if not flags & END_STREAM:
                raise H2Error(PROTOCOL_ERROR, "HEADERS again without END_STREAM")
        elif sid <= self.last_stream:
            raise H2Error(STREAM_CLOSED, f"HEADERS on closed stream {sid}")
        self.block = bytearray()
        self.block_stream, self.block_ends = sid, bool(flags & END_STREAM)
        self._block(payload, flags)

    def _block(self, payload: bytes, flags: int) -> None:
        assert self.block is not None
        self.block += payload
        if len(self.block) > HEADER_BLOCK_CAP:
            raise H2Error(PROTOCOL_ERROR, f"header block over {HEADER_BLOCK_CAP} bytes")
        if not flags & END_HEADERS:
            return
        block, sid, ends = bytes(self.block), self.block_stream, self.block_ends
        self.block = None
        too_large: HeadersTooLarge | None = None
        try:
            headers = self._decode(block)
        except HeadersTooLarge as exc:
            headers, too_large = [], exc
        stream = self.streams.get(sid)
        if stream is None:
            self.last_stream = sid
            if self.going_away or len(self.streams) >= MAX_STREAMS:
                self._write(frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
                return
            stream = self.streams[sid] = Stream(self.peer_window)
            if too_large is not None:
                self._answer(sid, stream, RESOURCE_EXHAUSTED, str(too_large), reset=not ends)
                return
            stream.headers = headers
            method = self.server.methods.get(dict(headers).get(b":path", b""))
            if method is not None and method.streaming:
                self._open(sid, stream, method)
                if self.streams.get(sid) is not stream:
                    return  # refused
        if too_large is not None:  # a request's trailers (gRPC clients send none)
            if stream.task is not None:
                stream.task.cancel()
                self._finish(sid, stream, RESOURCE_EXHAUSTED, str(too_large), reset=True)
            else:
                self._drop(sid, stream, str(too_large))
        elif stream.inbox is not None:
            if ends:
                self._stream_data(sid, stream, b"", True)
        elif ends:
            self._dispatch(sid, stream)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        try:
            return self.decoder.decode(block)
        except hpack.HPACKError as exc:
            raise H2Error(COMPRESSION_ERROR, f"header block: {exc}") from None

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2Error(PROTOCOL_ERROR, "DATA on stream 0")
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
                raise H2Error(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream already answered or reset: its data is dropped
        if stream.inbox is not None:
            self._stream_data(sid, stream, self._strip_padding(flags, payload), flags & END_STREAM)
            return
        if stream.task is not None:
            raise H2Error(STREAM_CLOSED, f"DATA after END_STREAM on stream {sid}")
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

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise H2Error(FRAME_SIZE_ERROR, "SETTINGS of a length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i : i + 2], "big")
            value = int.from_bytes(payload[i + 2 : i + 6], "big")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                for stream in self.streams.values():
                    stream.send_window += value - self.peer_window
                self.peer_window = value
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value < 1 << 24:
                    raise H2Error(PROTOCOL_ERROR, f"max frame size {value}")
                self.peer_frame = value
        self._write(frame(SETTINGS, ACK, 0))
        self._flush()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE must be 4 bytes")
        increment = int.from_bytes(payload, "big") & MAX_WINDOW
        if sid == 0:
            if increment == 0:
                raise H2Error(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise H2Error(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
        else:
            stream = self.streams.get(sid)
            if stream is None:
                return
            stream.send_window += increment
            if increment == 0 or stream.send_window > MAX_WINDOW:
                self.streams.pop(sid)
                cancel(stream)
                code = PROTOCOL_ERROR if increment == 0 else FLOW_CONTROL_ERROR
                self._write(frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))
                return
        self._flush()
