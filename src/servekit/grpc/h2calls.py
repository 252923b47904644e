"""How a connection of servekit's HTTP/2 server answers its calls (``Calls``, a mixin of
``h2._Connection``): a unary call's message run once it has all arrived; a streaming
call's messages handed over as they arrive (its connection left unread while they wait
untaken past a budget) and its responses written as they come (its method waiting while
the peer leaves them unread); each call ended with its status. Also what the frames
and the calls share: the ``Stream`` record and ``H2Error``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from ..batching.request import CLIENT_DEADLINE
from .calls import Aborted, CallContext, Method, Parts, deadline, inflated, unary_message
from .frames import (
    DATA,
    DEADLINE_EXCEEDED,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    INTERNAL,
    INVALID_ARGUMENT,
    NO_ERROR,
    OK,
    OK_TRAILERS,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    RST_STREAM,
    STREAM_CLOSED,
    UNIMPLEMENTED,
    UNKNOWN,
    frame,
    frame_header,
    grpc_prefix,
    grpc_prefix_of,
    status_block,
)

__all__ = ["STREAM_BACKLOG", "Calls", "H2Error", "Stream", "cancel"]

log = logging.getLogger("servekit.grpc.h2")

STREAM_BACKLOG = 1 << 20
"""Bytes of whole messages a streaming call may leave untaken before its connection stops
being read (one message of any size is always taken in)."""


class Outbox:
    """A stream's message bytes waiting to be sent, as views of the serialized messages:
    DATA frames are cut from them without copying (the connection joins a turn's writes
    into one buffer for the socket, the one copy)."""

    __slots__ = ("_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: collections.deque[memoryview] = collections.deque()
        self._size = 0

    def add(self, *pieces: bytes | memoryview) -> None:
        for piece in pieces:
            if piece:
                self._pieces.append(memoryview(piece))
                self._size += len(piece)

    def take(self, n: int) -> list[memoryview]:
        """The next ``n`` bytes (at most what is held), as views."""
        taken: list[memoryview] = []
        while n > 0 and self._pieces:
            head = self._pieces[0]
            if len(head) <= n:
                taken.append(self._pieces.popleft())
                n -= len(head)
                self._size -= len(head)
            else:
                taken.append(head[:n])
                self._pieces[0] = head[n:]
                self._size -= n
                n = 0
        return taken

    def __len__(self) -> int:
        return self._size


class Stream:
    """One HTTP/2 stream: a call's request as it arrives and its answer as it goes out."""

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
        self.out = Outbox()
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


class H2Error(Exception):
    """The peer broke HTTP/2 itself: its connection gets GOAWAY with ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def cancel(stream: Stream) -> None:
    if stream.timer is not None:
        stream.timer.cancel()
    if stream.task is not None:
        stream.task.cancel()


class Calls:
    """The calls of one connection; the connection (``h2._Connection``) provides what is
    declared here: its server, streams, budgets and writes."""

    server: Any
    streams: dict[int, Stream]
    buffered: int
    paused: set[str]
    send_window: int
    peer_frame: int
    going_away: bool

    if TYPE_CHECKING:  # the connection's own; declared for the type checker only

        def _write(self, *data: bytes | memoryview) -> None: ...

        def _pause(self, why: str) -> None: ...

        def _resume(self, why: str) -> None: ...

        def _turn(self) -> None: ...

        def close(self) -> None: ...

    def _drop(self, sid: int, stream: Stream, why: str) -> None:
        """Refuse a request still arriving: RESOURCE_EXHAUSTED; the rest of it is dropped."""
        self._release(stream)
        self._answer(sid, stream, RESOURCE_EXHAUSTED, why, reset=True)

    def _release(self, stream: Stream) -> None:
        self.buffered -= stream.size
        stream.size = 0
        stream.chunks = []
        self._taken(None, 0)

    def _dispatch(self, sid: int, stream: Stream) -> None:
        """The request has ended: check what the headers ask, then run the call."""
        data = b"".join(stream.chunks)
        self._release(stream)
        headers = dict(stream.headers)
        if self._refused(sid, stream, headers):
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
        self._run(sid, stream, self._call(sid, stream, method, message), timeout)

    def _refused(self, sid: int, stream: Stream, headers: dict[bytes, bytes]) -> bool:
        """Whether the call is not a gRPC call at all (answered so)."""
        if headers.get(b":method") != b"POST":
            self._answer(sid, stream, UNIMPLEMENTED, "gRPC calls are POST requests")
            return True
        if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            self._answer(sid, stream, UNKNOWN, "content-type must be application/grpc")
            return True
        return False

    def _run(self, sid: int, stream: Stream, call: Any, timeout: float | None) -> None:
        """Run a call's coroutine as the stream's task, expiring at its deadline."""
        context = None
        if timeout is not None:  # the batcher sheds what cannot be answered by then
            context = contextvars.copy_context()
            context.run(CLIENT_DEADLINE.set, time.monotonic() + timeout)
        task = self.server.loop.create_task(call, context=context)
        stream.task = task
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)
        if timeout is not None:
            stream.timer = self.server.loop.call_later(timeout, self._expire, sid, stream)

    def _open(self, sid: int, stream: Stream, method: Method) -> None:
        """A streaming call starts with its headers; its messages follow as they come."""
        headers = dict(stream.headers)
        if self._refused(sid, stream, headers):
            return
        try:
            timeout = deadline(headers.get(b"grpc-timeout"))
        except Aborted as exc:
            self._answer(sid, stream, exc.code, exc.details)
            return
        stream.inbox = asyncio.Queue()
        call = self._stream_call(sid, stream, method, headers.get(b"grpc-encoding"))
        self._run(sid, stream, call, timeout)

    def _stream_data(self, sid: int, stream: Stream, data: bytes, end: int | bool) -> None:
        """Whole messages to the call's inbox. Past twice the message limit held on this
        connection, frames wait unread (and the socket with them) until the calls take
        their messages: a client sending faster than its calls are answered is paused."""
        assert stream.inbox is not None and stream.task is not None
        if stream.ended:
            raise H2Error(STREAM_CLOSED, f"DATA after END_STREAM on stream {sid}")
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

    def _taken(self, stream: Stream | None, size: int) -> None:
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
        self, stream: Stream, method: Method, encoding: bytes | None
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
        self, sid: int, stream: Stream, method: Method, encoding: bytes | None
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
                    stream.out.add(grpc_prefix(body), body)
                    self._send(sid, stream)
                    if len(stream.out) > self.server.max_unsent_bytes:
                        stream.drained = asyncio.Event()
                        await stream.drained.wait()
                        stream.drained = None
        except (asyncio.CancelledError, Exception) as exc:
            status = _failed(method, context, exc)
            if status is not None:
                self._finish(sid, stream, *status)
            return
        finally:
            # A method that handed its requests to a task of its own and left it running
            # holds the generator: it is closed with that task, then.
            with contextlib.suppress(RuntimeError):
                await requests.aclose()
        self._finish(sid, stream, OK, "")

    def _finish(
        self, sid: int, stream: Stream, code: int, message: str, *, reset: bool = False
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

    def _expire(self, sid: int, stream: Stream) -> None:
        if self.streams.get(sid) is stream and stream.task is not None:
            stream.timer = None
            stream.task.cancel()
            self._finish(sid, stream, DEADLINE_EXCEEDED, "deadline exceeded")

    async def _call(self, sid: int, stream: Stream, method: Method, message: bytes) -> None:
        context = CallContext(stream.headers, len(message))
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
        except (asyncio.CancelledError, Exception) as exc:
            status = _failed(method, context, exc)
            if status is not None:
                self._answer(sid, stream, *status)
            return
        body = response.parts if isinstance(response, Parts) else [response.SerializeToString()]
        self._answer(sid, stream, OK, "", body)

    def _answer(
        self,
        sid: int,
        stream: Stream,
        code: int,
        message: str,
        body: list[bytes | memoryview] | None = None,
        *,
        reset: bool = False,
    ) -> None:
        """Headers, the message (if any: ``body``'s pieces, unframed) and the trailers; one
        write when the windows allow."""
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
        stream.out.add(grpc_prefix_of(sum(len(p) for p in body)), *body)
        stream.trailers = OK_TRAILERS if code == OK else status_block(code, message)
        self._send(sid, stream)

    def _send(self, sid: int, stream: Stream) -> None:
        """As much of the stream's message as the windows allow, then (all sent) its trailers."""
        out = stream.out
        frames: list[bytes | memoryview] = []
        while out:
            n = min(len(out), self.peer_frame, self.send_window, stream.send_window)
            if n <= 0:
                break
            frames.append(frame_header(DATA, 0, sid, n))
            frames.extend(out.take(n))
            self.send_window -= n
            stream.send_window -= n
        done = not stream.out and stream.trailers
        if done:
            frames.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, stream.trailers))
            if stream.inbox is not None and not stream.ended:  # the client may stop sending
                frames.append(frame(RST_STREAM, 0, sid, NO_ERROR.to_bytes(4, "big")))
        self._write(*frames)
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


def _failed(method: Method, context: CallContext, exc: BaseException) -> tuple[int, str] | None:
    """The status a call ends with when its method raised ``exc``: the servicer's abort,
    UNIMPLEMENTED for a method it lacks, INTERNAL (logged) for anything unexpected; None
    when it was cancelled (reset by the client or past its deadline: answered already, or
    nobody asks)."""
    if isinstance(exc, asyncio.CancelledError):
        return None
    if isinstance(exc, Aborted):
        return exc.code, exc.details
    if isinstance(exc, NotImplementedError):
        return context.status[0] or UNIMPLEMENTED, context.status[1] or method.name
    log.exception("unexpected error in gRPC call %s", method.name, exc_info=exc)
    return INTERNAL, f"internal error: {type(exc).__name__}"
