"""Bidirectional streams on servekit's own gRPC server (``grpc.h2``), with a bare server
and methods written for the test: each response goes out as the method yields it, the
method sees each request as it arrives, and whatever a client does with a stream (floods
it, never reads it, resets it, abandons it) costs bounded memory and leaves the server
and its other connections serving. Triton's ``ModelStreamInfer`` on every runtime is
tested in ``test_streaming.py``."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

grpc = pytest.importorskip("grpc")
hpack = pytest.importorskip("hpack")

from conftest import wait_until  # noqa: E402
from h2raw import RawH2  # noqa: E402
from servekit.endpoints import free_port  # noqa: E402
from servekit.grpc.calls import Method, Raw  # noqa: E402
from servekit.grpc.frames import DATA, grpc_message  # noqa: E402
from servekit.grpc.h2 import GrpcH2Server  # noqa: E402
from servekit.store import rss_bytes  # noqa: E402

LIMIT = 1 << 20
ECHO, HOLD, FIREHOSE, PING = "/t.S/Echo", "/t.S/Hold", "/t.S/Firehose", "/t.S/Ping"


class Methods:
    """What the test's server serves, and what its methods saw."""

    def __init__(self) -> None:
        self.open = 0  # generators running now
        self.taken = 0  # messages Hold has taken
        self.yielded = 0  # messages Firehose has yielded
        self.release = threading.Event()

    async def echo(self, requests, context):
        """Each request back, upper-cased; "fail" ends the call with INVALID_ARGUMENT."""
        self.open += 1
        try:
            async for request in requests:
                if request.data == b"fail":
                    await context.abort(3, "asked to fail")
                yield Raw(request.data.upper())
        finally:
            self.open -= 1

    async def hold(self, requests, context):
        """Takes one message, then waits until the test lets it go on."""
        self.open += 1
        try:
            async for _ in requests:
                self.taken += 1
                while not self.release.is_set():
                    await asyncio.sleep(0.01)
            yield Raw(b"done")
        finally:
            self.open -= 1

    async def firehose(self, requests, context):
        """64 KB responses for as long as the peer takes them."""
        self.open += 1
        try:
            while True:
                self.yielded += 1
                yield Raw(bytes(64 * 1024))
        finally:
            self.open -= 1

    async def ping(self, request, context):
        return Raw(b"pong")


@pytest.fixture
def served():
    """A GrpcH2Server with the test's methods on a loop of its own."""
    methods = Methods()
    table = {
        ECHO.encode(): Method("Echo", Raw, methods.echo, streaming=True),
        HOLD.encode(): Method("Hold", Raw, methods.hold, streaming=True),
        FIREHOSE.encode(): Method("Firehose", Raw, methods.firehose, streaming=True),
        PING.encode(): Method("Ping", Raw, methods.ping),
    }
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    h2 = GrpcH2Server(table, "127.0.0.1", free_port(), LIMIT, max_unsent_bytes=256 * 1024)
    asyncio.run_coroutine_threadsafe(h2.start(), loop).result(10)

    class Config:  # what h2raw.address reads
        class config:  # noqa: N801
            class server:  # noqa: N801
                grpc_url = f"grpc://127.0.0.1:{h2.port}"

    methods.target = Config
    methods.address = f"127.0.0.1:{h2.port}"
    methods.release.set()  # Hold lets go unless a test says otherwise
    try:
        yield methods
        with grpc.insecure_channel(methods.address) as channel:  # still serving
            assert channel.unary_unary(PING)(b"", timeout=10) == b"pong"
    finally:
        methods.release.set()
        asyncio.run_coroutine_threadsafe(h2.stop(0.5), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_each_request_is_answered_as_it_arrives_in_order(served):
    with grpc.insecure_channel(served.address) as channel:
        echo = channel.stream_stream(ECHO)
        words = [f"word {i}".encode() for i in range(200)]
        assert list(echo(iter(words), timeout=30)) == [w.upper() for w in words]

        # One at a time: each answer comes before the next request is sent.
        asked: list[bytes] = []
        ready = threading.Event()

        def requests():
            for i in range(5):
                asked.append(f"step {i}".encode())
                ready.clear()
                yield asked[-1]
                assert ready.wait(10), "no answer before the next request"

        for answer in echo(requests(), timeout=30):
            assert answer == asked[-1].upper()
            ready.set()


def test_a_method_that_aborts_ends_the_stream_with_its_status_after_its_answers(served):
    with grpc.insecure_channel(served.address) as channel:
        got = []
        with pytest.raises(grpc.RpcError) as info:
            for answer in channel.stream_stream(ECHO)(
                iter([b"a", b"b", b"fail", b"c"]), timeout=30
            ):
                got.append(answer)
        assert got == [b"A", b"B"]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "asked to fail"
    wait_until(lambda: served.open == 0, "the generator closed", 5)


def test_a_cancelled_or_expired_stream_closes_its_method(served):
    served.release.clear()
    with grpc.insecure_channel(served.address) as channel:
        call = channel.stream_stream(HOLD)(iter([b"x"]), timeout=30)
        wait_until(lambda: served.taken == 1, "the method took the request", 10)
        call.cancel()
        wait_until(lambda: served.open == 0, "the generator closed on cancel", 10)

        start = time.perf_counter()
        with pytest.raises(grpc.RpcError) as info:
            list(channel.stream_stream(HOLD)(iter([b"x"]), timeout=0.3))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.perf_counter() - start < 5
        wait_until(lambda: served.open == 0, "the generator closed at the deadline", 10)


def test_a_message_over_the_limit_ends_that_stream_only(served):
    with grpc.insecure_channel(served.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            list(channel.stream_stream(ECHO)(iter([b"ok", bytes(LIMIT + 1)]), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(LIMIT) in info.value.details()
        assert list(channel.stream_stream(ECHO)(iter([b"again"]), timeout=30)) == [b"AGAIN"]


def _stream(raw: RawH2, sid: int, path: str) -> None:
    raw.call(sid, b"", path=path, end=False)


def test_a_stream_flooded_faster_than_its_method_takes_pauses_its_connection(served):
    """The method holds its first message; the client sends 64 MB more. The server stops
    reading the connection past its backlog, so the client's sends block, and memory
    stays bounded; another connection is served meanwhile."""
    served.release.clear()
    before = rss_bytes()
    with RawH2(served.target) as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        raw.sock.settimeout(2)
        _stream(raw, 1, HOLD)
        message = grpc_message(bytes(60_000))
        blob = b"".join(raw_frame(1, message) for _ in range(16))
        sent = 0
        try:
            for _ in range(64 * 1024 * 1024 // len(blob)):
                raw.sock.sendall(blob)
                sent += len(blob)
        except (TimeoutError, OSError):
            pass  # the server stopped reading us
        assert sent < 16 * 1024 * 1024, sent
        assert rss_bytes() - before < 48 * 1024 * 1024
        with grpc.insecure_channel(served.address) as channel:
            assert channel.unary_unary(PING)(b"", timeout=10) == b"pong"
        served.release.set()  # the method takes its messages again, and reading resumes
        wait_until(lambda: served.taken > 20, "the held messages were taken", 20)


def raw_frame(sid: int, message: bytes) -> bytes:
    from servekit.grpc.frames import frame

    return frame(DATA, 0, sid, message)


def test_a_stream_whose_responses_are_never_read_stops_its_method(served):
    """Firehose yields for as long as the peer takes: a peer that never reads (window never
    opened) leaves the generator waiting, with a bounded number of responses made."""
    with RawH2(served.target) as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        _stream(raw, 1, FIREHOSE)
        wait_until(lambda: served.yielded > 0, "the method began", 10)
        time.sleep(1.0)
        made = served.yielded
        time.sleep(1.0)
        assert served.yielded == made, "the method went on for a peer that does not read"
        assert made < 64, made  # the stream's unsent budget and the windows, no more
    wait_until(lambda: served.open == 0, "the generator closed with the connection", 10)


def test_streams_opened_and_abandoned_are_bounded_and_closed_with_their_connection(served):
    with RawH2(served.target) as raw:
        for sid in range(1, 401, 2):  # 200 asked, 100 taken (the limit per connection)
            _stream(raw, sid, ECHO)
        wait_until(lambda: served.open == 100, "a hundred streams open", 10)
        with grpc.insecure_channel(served.address) as channel:
            assert channel.unary_unary(PING)(b"", timeout=10) == b"pong"
    wait_until(lambda: served.open == 0, "every abandoned stream closed", 10)
