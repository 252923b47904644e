"""HTTP/2 and gRPC on the wire, as servekit's gRPC server and client (and the tests and
benchmarks that speak raw HTTP/2 to them) write and read it: frame types, flags, error
and settings codes, the frame codec, HPACK's stateless literal encoding and gRPC's status
trailers and message framing. Nothing here keeps state."""

from __future__ import annotations

import urllib.parse

__all__ = [
    "ACK", "CANCEL", "CANCELLED", "COMPRESSION_ERROR", "CONTINUATION", "DATA",
    "DEADLINE_EXCEEDED", "END_HEADERS", "END_STREAM", "ENHANCE_YOUR_CALM",
    "FLOW_CONTROL_ERROR", "FRAME_SIZE_ERROR", "GOAWAY", "GRPC_CONTENT", "HEADERS", "INDEXED",
    "INTERNAL", "INTERNAL_ERROR", "INVALID_ARGUMENT", "MAX_WINDOW", "NO_ERROR", "OK",
    "OK_TRAILERS", "PADDED", "PING", "PREFACE", "PRIORITY", "PRIORITY_FLAG",
    "PROTOCOL_ERROR", "PUSH_PROMISE", "REFUSED_STREAM", "RESOURCE_EXHAUSTED",
    "RESPONSE_HEADERS", "RST_STREAM", "SETTINGS", "STATUS_200", "STREAM_CLOSED",
    "S_HEADER_TABLE_SIZE", "S_INITIAL_WINDOW_SIZE", "S_MAX_CONCURRENT_STREAMS",
    "S_MAX_FRAME_SIZE", "S_MAX_HEADER_LIST_SIZE", "TIMEOUT_UNITS", "UNAVAILABLE",
    "UNIMPLEMENTED", "UNKNOWN", "WINDOW_UPDATE", "frame", "frame_header", "frame_length",
    "grpc_message", "grpc_prefix", "grpc_prefix_of",
    "hpack_int", "literal", "next_frame", "status_block",
]  # fmt: skip

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
ENHANCE_YOUR_CALM = 11
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
S_HEADER_TABLE_SIZE, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE = 1, 3, 4
S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 5, 6

MAX_WINDOW = 2**31 - 1
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 1, 2, 3, 4
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14
INDEXED = bytes(range(0x81, 0xFF))
"""First bytes of HPACK's one-byte indexed fields (index 1-126)."""
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return frame_header(kind, flags, stream, len(payload)) + payload


def frame_header(kind: int, flags: int, stream: int, length: int) -> bytes:
    """The nine bytes before a frame's payload (written apart from a large payload, so the
    payload is not copied to join them)."""
    return length.to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big")


def hpack_int(value: int, bits: int, first: int = 0) -> bytes:
    """HPACK's integer with a ``bits``-bit prefix (RFC 7541 5.1)."""
    limit = (1 << bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header as a literal never added to the dynamic table: the encoder keeps no state."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


STATUS_200 = b"\x88"  # :status 200, static table entry 8
GRPC_CONTENT = literal(b"content-type", b"application/grpc")
RESPONSE_HEADERS = STATUS_200 + GRPC_CONTENT
OK_TRAILERS = literal(b"grpc-status", b"0")


GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if c != 0x25)
"""grpc-message keeps printable ASCII but '%' as it is; the rest is %XX of UTF-8."""


def status_block(code: int, message: str) -> bytes:
    block = literal(b"grpc-status", str(code).encode())
    if message:
        quoted = urllib.parse.quote(message[:4096], safe=GRPC_MESSAGE_SAFE)
        block += literal(b"grpc-message", quoted.encode())
    return block


def next_frame(buffer: bytes | bytearray, pos: int = 0) -> tuple[int, int, int, bytes, int] | None:
    """The whole frame at ``pos`` of ``buffer``: (kind, flags, stream, payload, the
    position after it), or None while it has not all arrived."""
    end = len(buffer)
    if end - pos < 9:
        return None
    length = int.from_bytes(buffer[pos : pos + 3], "big")
    if end - pos < 9 + length:
        return None
    kind, flags = buffer[pos + 3], buffer[pos + 4]
    stream = int.from_bytes(buffer[pos + 5 : pos + 9], "big") & MAX_WINDOW
    with memoryview(buffer) as view:  # one copy of the payload (a slice, then bytes(), is two)
        payload = bytes(view[pos + 9 : pos + 9 + length])
    return kind, flags, stream, payload, pos + 9 + length


def frame_length(buffer: bytes | bytearray, pos: int = 0) -> int | None:
    """The payload length the frame header at ``pos`` declares (None: no header yet)."""
    return int.from_bytes(buffer[pos : pos + 3], "big") if len(buffer) - pos >= 9 else None


def grpc_message(body: bytes, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message (the compressed flag, four length bytes, the body)."""
    return grpc_prefix(body, compressed) + body


def grpc_prefix(body: bytes, compressed: bool = False) -> bytes:
    """The five bytes before a gRPC message's body (sent apart from a large body)."""
    return grpc_prefix_of(len(body), compressed)


def grpc_prefix_of(length: int, compressed: bool = False) -> bytes:
    """The five bytes before a gRPC message body of ``length`` bytes."""
    return bytes((int(compressed),)) + length.to_bytes(4, "big")
