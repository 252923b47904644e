"""One gRPC call as a servicer sees it, apart from HTTP/2: the method table, the context a
method may use, and the length-prefixed messages of a request.

A unary method is a coroutine ``(request, context) -> response``; a streaming one (only
bidirectional streams are served) an async generator ``(requests, context)`` yielding
responses, where ``requests`` is an async iterator of request messages, as in
``grpc.aio``. Either ends a call with a status by ``await context.abort(code, details)``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from ..compression import ENCODINGS, inflate
from ..errors import InvalidInput
from .frames import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, TIMEOUT_UNITS, UNIMPLEMENTED

__all__ = [
    "Aborted",
    "CallContext",
    "Method",
    "Raw",
    "code_number",
    "deadline",
    "each_answered",
    "once",
    "inflated",
    "service_methods",
    "unary_message",
    "varint",
]


class Method:
    """One method: its request message class and what answers it (``streaming``: an async
    generator over a stream of requests, else a coroutine over one)."""

    __slots__ = ("handler", "name", "request_type", "streaming")

    def __init__(self, name: str, request_type: Any, handler: Any, streaming: bool = False) -> None:
        self.name, self.request_type, self.handler = name, request_type, handler
        self.streaming = streaming


def service_methods(servicer: Any, service: Any, messages: Any) -> dict[bytes, Method | None]:
    """``/package.Service/Method`` -> Method, from a protobuf ``ServiceDescriptor`` whose
    message classes are in module ``messages``. A bidirectional method is served where the
    servicer implements it as an async generator; other streaming methods map to None."""
    table: dict[bytes, Method | None] = {}
    for m in service.methods:
        path = f"/{service.full_name}/{m.name}".encode()
        kind = getattr(messages, m.input_type.name)
        handler = getattr(servicer, m.name)
        if not (m.client_streaming or m.server_streaming):
            table[path] = Method(m.name, kind, handler)
        elif m.client_streaming and m.server_streaming and inspect.isasyncgenfunction(handler):
            table[path] = Method(m.name, kind, handler, streaming=True)
        else:
            table[path] = None
    return table


class Parts:
    """A response serialized in pieces: a message's small fields, then large byte fields
    as views of the arrays that hold them. The server sends the pieces as they are (no
    copy joins them); ``SerializeToString`` joins them where one ``bytes`` is needed."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[bytes | memoryview]) -> None:
        self.parts = parts

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return b"".join(self.parts)


def bytes_field(number: int, value: bytes | memoryview) -> list[bytes | memoryview]:
    """A length-delimited protobuf field (a ``bytes`` field's one entry) as two pieces: its
    key and length, then ``value`` itself. Fields may follow a message's others in any
    order, so these appended to a serialized message are that message with them added."""
    return [varint(number << 3 | 2) + varint(len(value)), value]


class Raw:
    """A message as its bytes: what a relayed method takes and answers, and a response
    already serialized (the server sends it as it is)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def FromString(cls, data: bytes) -> Raw:  # noqa: N802 (protobuf's name)
        return cls(data)

    def SerializeToString(self) -> bytes:  # noqa: N802
        return self.data


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of ``n``."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class Aborted(Exception):
    """A call ended with a status other than OK (``context.abort``)."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def code_number(code: Any) -> int:
    """A grpc.StatusCode (whose value is ``(number, name)``) or a plain number."""
    value = getattr(code, "value", code)
    return int(value[0] if isinstance(value, tuple) else value)


class CallContext:
    """What a servicer method may ask of its call (grpc.aio's ``ServicerContext``, in part)."""

    __slots__ = ("_code", "_details", "_headers", "size")

    def __init__(self, headers: list[tuple[bytes, bytes]], size: int | None = None) -> None:
        self._headers = headers
        self._code: int | None = None
        self._details = ""
        self.size = size
        """The request message's size in bytes, where the server read it whole (unary)."""

    def invocation_metadata(self) -> list[tuple[str, str | bytes]]:
        """The call's metadata: its headers but HTTP/2's own, values of -bin keys as bytes."""
        return [
            (k.decode("latin-1"), v if k.endswith(b"-bin") else v.decode("latin-1"))
            for k, v in self._headers
            if not k.startswith(b":")
        ]

    async def abort(self, code: Any, details: str = "") -> None:
        raise Aborted(code_number(code), details)

    def set_code(self, code: Any) -> None:
        self._code = code_number(code)

    def set_details(self, details: str) -> None:
        self._details = details

    @property
    def status(self) -> tuple[int | None, str]:
        """The code and details set on the context, if any."""
        return self._code, self._details


def inflated(compressed: bool, payload: bytes, encoding: bytes | None, limit: int) -> bytes:
    """One message's bytes, decompressed if its flag says so (``Aborted`` if it cannot be,
    or if it is larger than ``limit`` once inflated)."""
    if not compressed:
        return payload
    name = (encoding or b"").decode("latin-1")
    if name not in ENCODINGS:
        raise Aborted(
            UNIMPLEMENTED, f"message compressed as {encoding!r}; this server takes gzip or deflate"
        )
    try:
        message = inflate(payload, name, limit, "the request message")
    except InvalidInput as exc:
        raise Aborted(INVALID_ARGUMENT, str(exc)) from None
    if len(message) > limit:
        raise Aborted(RESOURCE_EXHAUSTED, f"request message larger than the limit of {limit} bytes")
    return message


def unary_message(data: bytes, encoding: bytes | None, limit: int) -> bytes:
    """The one message of a unary request, decompressed if it says so."""
    if len(data) < 5:
        raise Aborted(INVALID_ARGUMENT, "the request carries no complete gRPC message")
    length = int.from_bytes(data[1:5], "big")
    if len(data) != 5 + length:
        what = "more than one message" if len(data) > 5 + length else "a truncated message"
        raise Aborted(INVALID_ARGUMENT, f"a unary request carries {what}")
    return inflated(bool(data[0]), memoryview(data)[5:], encoding, limit)  # type: ignore[arg-type]


def deadline(value: bytes | None) -> float | None:
    """``grpc-timeout`` in seconds (None without one)."""
    if value is None:
        return None
    unit = TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        raise Aborted(INVALID_ARGUMENT, f"grpc-timeout {value.decode(errors='replace')!r}")
    return int(value[:-1]) * unit


_READ = object()
"""What the reader of ``each_answered`` leaves when the stream's requests end."""
_ENDED = object()
"""What a call of ``each_answered`` leaves after its last response."""


async def each_answered(
    requests: AsyncIterator[Any],
    answer: Callable[[Any], AsyncIterator[Any]],
    limit: int,
) -> AsyncGenerator[tuple[Any, Any], None]:
    """``(request, response)`` for each response to each request of a stream: every
    request answered as its own call (``answer(request)``: its responses, one for a
    unary model, any number for a decoupled one), concurrently, each response yielded as
    it comes. At most ``limit`` requests are taken and not yet answered in full (past it
    the stream's requests wait unread). A call that aborts gives its ``Aborted``, and one
    that fails otherwise its exception, as its last response: one bad request never
    ends the stream. Closed early, every call still running is cancelled."""
    done: asyncio.Queue[tuple[Any, Any]] = asyncio.Queue()
    slots = asyncio.Semaphore(limit)
    calls: set[asyncio.Task[None]] = set()
    started = 0

    async def one(request: Any) -> None:
        try:
            async for response in answer(request):
                done.put_nowait((request, response))
        except Exception as exc:  # Aborted and the rest: the caller words it
            done.put_nowait((request, exc))
        done.put_nowait((request, _ENDED))

    async def read() -> None:
        nonlocal started
        try:
            async for request in requests:
                await slots.acquire()
                started += 1
                call = asyncio.create_task(one(request))
                calls.add(call)
                call.add_done_callback(calls.discard)
        except Exception as exc:  # the stream itself is broken (a message that is none)
            done.put_nowait((_READ, exc))
        else:
            done.put_nowait((_READ, None))

    reader = asyncio.create_task(read())
    read_all, answered = False, 0
    try:
        while not read_all or answered < started:
            request, outcome = await done.get()
            if request is _READ:
                if outcome is not None:
                    raise outcome
                read_all = True
            elif outcome is _ENDED:
                answered += 1
                slots.release()
            else:
                yield request, outcome
    finally:
        reader.cancel()
        for call in list(calls):
            call.cancel()
        # Let them end here: the stream's requests are closed after this, and closing an
        # async generator a task still awaits in is an error.
        await asyncio.wait([reader, *calls])


async def once(answer: Awaitable[Any]) -> AsyncIterator[Any]:
    """A unary call's one response, as ``each_answered`` takes responses."""
    yield await answer
