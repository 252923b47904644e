"""servekit's own gRPC server (``servekit.grpc.h2``) on the native runtime: grpcio's and
tritonclient's clients unchanged, servekit's own client (``grpc.h2client``), and HTTP/2
spoken by hand over a raw socket (``h2raw``) for what a polite client never sends.
Whatever one connection does, the server and every other connection go on. The
denial-of-service classes run against every runtime in ``test_public_grpc.py``."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import os
import socket
import threading
import time

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")
hpack = pytest.importorskip("hpack")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from conftest import wait_until  # noqa: E402
from h2raw import (  # noqa: E402
    INFER,
    RawH2,
    adder_request,
    address,
    sums,
)
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.grpc.frames import (  # noqa: E402
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    grpc_message,
)
from servekit.native import NativeServer  # noqa: E402
from servekit.zoo.tiny import build_simulated  # noqa: E402

WIDE = 100_000
"""The wide model's row: 400 KB in and out, more than HTTP/2's default window."""
LIMIT = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory, add_sub_path):
    folder = tmp_path_factory.mktemp("h2")
    slow, wide = folder / "slow.onnx", folder / "wide.onnx"
    onnx.save(build_simulated(f"h2-slow-{os.getpid()}", 1_500_000, 0), slow)
    identity = build_simulated("wide", 0, 0, width=WIDE)
    del identity.metadata_props[:]  # no device profile: ONNX Runtime runs its Identity
    onnx.save(identity, wide)
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_us=200)
    config = ServeConfig(
        (
            ModelConfig(str(add_sub_path), "adder", batching=policy),
            ModelConfig(str(slow), "slow", batching=policy),
            ModelConfig(str(wide), "wide", batching=policy),
        ),
        ServerConfig(exit_timeout_s=5, max_body_bytes=LIMIT),
        runtime="native",
    ).on_loopback()
    with NativeServer(config) as native:
        yield native


def slow_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(bytes(64))
    return request


@pytest.fixture
def live(server):
    """A channel opened before the test and checked after it: the server is still up."""
    channel = grpc.insecure_channel(address(server))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    assert sums(stub.ModelInfer(adder_request(1.0), timeout=30))[0] == 2.0
    yield stub
    assert sums(stub.ModelInfer(adder_request(2.0), timeout=30))[0] == 4.0
    channel.close()


def test_many_calls_in_flight_on_one_channel_each_get_their_own_answer(live):
    futures = [live.ModelInfer.future(adder_request(float(i)), timeout=60) for i in range(64)]
    for i, future in enumerate(futures):
        assert np.all(sums(future.result()) == 2.0 * i)


@pytest.mark.parametrize("compression", [grpc.Compression.Gzip, grpc.Compression.Deflate])
def test_compressed_requests_are_inflated(server, compression):
    with grpc.insecure_channel(address(server), compression=compression) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        assert np.all(sums(stub.ModelInfer(adder_request(3.0), timeout=30)) == 6.0)


def test_tensors_larger_than_the_window_travel_both_ways(server):
    client = grpcclient.InferenceServerClient(address(server))
    try:
        data = np.random.default_rng(0).standard_normal((3, WIDE)).astype(np.float32)
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        result = client.infer("wide", [tensor])
        assert np.array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def test_the_server_keeps_to_the_clients_flow_control_window(server):
    # The client's window is 16 KiB: the server sends that much of the 400 KB answer,
    # then waits for each WINDOW_UPDATE.
    with RawH2(server, settings_payload=(4).to_bytes(2, "big") + (16384).to_bytes(4, "big")) as raw:
        data = np.arange(WIDE, dtype=np.float32)[None]
        request = service_pb2.ModelInferRequest(model_name="wide")
        request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, WIDE])
        request.raw_input_contents.append(data.tobytes())
        body = request.SerializeToString()
        message = grpc_message(body)
        # 16 KiB frames: the server's frames may be larger, the client's here are not.
        raw.call(1, message[:16384], end=False)
        for at in range(16384, len(message), 16384):
            last = at + 16384 >= len(message)
            raw.send(DATA, END_STREAM if last else 0, 1, message[at : at + 16384])
        window = [16384]
        stalls = [0]

        def on_data(payload: bytes) -> None:
            window[0] -= len(payload)
            assert window[0] >= 0, "the server sent past the client's window"
            if window[0] > 0:
                return
            if stalls[0] < 3:  # the window is spent: nothing more comes until it grows
                stalls[0] += 1
                raw.sock.settimeout(0.3)
                try:
                    got = raw.frame()
                    assert got is None or got[0] != DATA, "DATA past the client's window"
                except TimeoutError:
                    pass
                finally:
                    raw.sock.settimeout(10)
            window[0] = 16384
            raw.send(WINDOW_UPDATE, 0, 1, (16384).to_bytes(4, "big"))
            raw.send(WINDOW_UPDATE, 0, 0, (16384).to_bytes(4, "big"))

        headers, answer, trailers = raw.response(1, on_data)
        assert headers[":status"] == "200" and trailers["grpc-status"] == "0", trailers
        response = service_pb2.ModelInferResponse.FromString(answer[5:])
        assert np.array_equal(np.frombuffer(response.raw_output_contents[0], np.float32), data[0])
        assert stalls[0] == 3


def test_grpc_timeout_ends_a_call_with_deadline_exceeded(live, server):
    with RawH2(server) as raw:
        request = slow_request()
        start = time.monotonic()
        raw.call(1, grpc_message(request.SerializeToString()), headers=[("grpc-timeout", "200m")])
        _, _, trailers = raw.response(1)
        assert trailers["grpc-status"] == "4"  # DEADLINE_EXCEEDED
        assert time.monotonic() - start < 1.4  # before the slow model's 1.5 s
        assert raw.add(3, 5.0) == 10.0


def test_a_reset_call_is_cancelled_and_the_connection_goes_on(live, server):
    with RawH2(server) as raw:
        request = slow_request()
        raw.call(1, grpc_message(request.SerializeToString()))
        raw.send(RST_STREAM, 0, 1, (8).to_bytes(4, "big"))  # CANCEL
        raw.send(PING, 0, 0, b"pingpong")
        assert raw.add(3, 1.5) == 3.0


def test_ping_is_answered_with_its_payload(server):
    with RawH2(server) as raw:
        raw.send(PING, 0, 0, b"12345678")
        while (got := raw.frame()) is not None:
            if got[0] == PING:
                assert got[1] == 1 and got[3] == b"12345678"
                break
        else:
            pytest.fail("no PING ACK")


def test_unknown_methods_are_unimplemented(live, server):
    with grpc.insecure_channel(address(server)) as channel:
        for method in ("/inference.GRPCInferenceService/Nope", "/other.Service/ModelInfer"):
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(method)(b"", timeout=30)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert method in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # a method the service does not serve
            channel.unary_unary("/inference.GRPCInferenceService/RepositoryModelLoad")(
                b"", timeout=30
            )
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_message_over_the_limit_is_refused_and_the_channel_goes_on(live):
    request = adder_request(1.0)
    request.raw_input_contents[0] = bytes(LIMIT + 1)
    with pytest.raises(grpc.RpcError) as info:
        live.ModelInfer(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(LIMIT) in info.value.details()


def test_unfinished_requests_on_one_connection_are_bounded(live, server):
    # Each stream may hold up to the message limit while its request arrives; all of a
    # connection's together at most twice that: the stream that would pass it is refused.
    with RawH2(server) as raw:
        part = bytes(16384)
        for sid in (1, 3, 5):
            raw.call(sid, part, end=False)
            for _ in range(LIMIT * 3 // 4 // len(part)):
                raw.send(DATA, 0, sid, part)
        _, _, trailers = raw.response(5)
        assert trailers["grpc-status"] == "8", trailers  # RESOURCE_EXHAUSTED
        assert "unfinished requests" in trailers["grpc-message"]
        raw.send(RST_STREAM, 0, 1, (8).to_bytes(4, "big"))  # frees what stream 1 held
        assert raw.add(7, 1.0) == 2.0


@pytest.mark.parametrize(
    "message, headers, code, words",
    [
        (grpc_message(b"\xff\xff\xff"), [], "3", "not a ModelInferRequest"),
        (grpc_message(b"") * 2, [], "3", "more than one message"),
        (grpc_message(b"")[:3], [], "3", "no complete gRPC message"),
        (grpc_message(b"abc")[:6], [], "3", "truncated"),
        (grpc_message(b"x", compressed=True), [("grpc-encoding", "snappy")], "12", "snappy"),
        (
            grpc_message(b"not gzip", compressed=True),
            [("grpc-encoding", "gzip")],
            "3",
            "decompress",
        ),
        (
            grpc_message(gzip.compress(adder_request(1.0).SerializeToString(), mtime=0)[:-8], True),
            [("grpc-encoding", "gzip")],
            "3",
            "ends early",
        ),
        (grpc_message(b""), [("grpc-timeout", "soon")], "3", "grpc-timeout"),
        (grpc_message(b""), [("content-type", "text/plain")], "2", "application/grpc"),
    ],
)
def test_bad_calls_get_a_status_naming_the_problem(live, server, message, headers, code, words):
    with RawH2(server) as raw:
        if headers and headers[0][0] == "content-type":
            block = raw.encoder.encode(
                [(":method", "POST"), (":scheme", "http"), (":path", INFER),
                 (":authority", "test"), *headers]
            )  # fmt: skip
            raw.send(HEADERS, END_HEADERS, 1, block)
            raw.send(DATA, END_STREAM, 1, message)
        else:
            raw.call(1, message, headers=headers)
        _, _, trailers = raw.response(1)
        assert trailers["grpc-status"] == code, trailers
        assert words in trailers.get("grpc-message", ""), trailers
        assert raw.add(3, 2.5) == 5.0  # the same connection goes on


@pytest.mark.parametrize(
    "send, code",
    [
        (lambda raw: None, None),  # the preface itself is wrong: see the parameter below
        (lambda raw: raw.sock.sendall(frame(DATA, 0, 0, b"x")), 1),
        (lambda raw: raw.sock.sendall((1 << 21).to_bytes(3, "big") + bytes(6)), 6),
        (
            lambda raw: raw.sock.sendall(
                frame(HEADERS, 0, 1, raw.encoder.encode([(":method", "POST")]))
                + frame(PING, 0, 0, bytes(8))
            ),
            1,
        ),
        (lambda raw: raw.sock.sendall(frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff")), 9),
        (lambda raw: raw.sock.sendall(frame(SETTINGS, 0, 0, b"\x00\x04\xff\xff\xff\xff")), 3),
        (lambda raw: raw.sock.sendall(frame(CONTINUATION, END_HEADERS, 1, b"")), 1),
    ],
    ids=["preface", "data-on-0", "huge-frame", "interrupted-headers", "hpack", "window", "cont"],
)
def test_broken_http2_gets_goaway_and_closes_that_connection_only(live, server, send, code):
    preface = b"GET / HTTP/1.1\r\n\r\n" + bytes(6) if code is None else PREFACE
    with RawH2(server, preface=preface) as raw:
        send(raw)
        got = raw.goaway()
        assert got is not None and got[0] == (1 if code is None else code), got


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_after_the_preface_never_stop_the_server(live, server, junk):
    with RawH2(server) as raw:
        raw.sock.sendall(junk)
        raw.sock.settimeout(0.2)
        try:
            while raw.frame() is not None:
                pass
        except TimeoutError:
            pass
    assert sums(live.ModelInfer(adder_request(4.0), timeout=30))[0] == 8.0


def test_stop_answers_the_calls_in_flight(tmp_path):
    slow = tmp_path / "slow.onnx"
    onnx.save(build_simulated(f"h2-stop-{os.getpid()}", 800_000, 0), slow)
    config = ServeConfig(
        (ModelConfig(str(slow), "slow", batching=BatchingPolicy(max_batch_size=4)),),
        ServerConfig(exit_timeout_s=5),
        runtime="native",
    ).on_loopback()
    native = NativeServer(config).start()
    answers: list[object] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(address(native))
        tensor = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
        try:
            answers.append(client.infer("slow", [tensor]).as_numpy("OUTPUT0"))
        except Exception as exc:
            answers.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=call) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        stats = native.models.batchers["slow"].stats
        wait_until(lambda: stats.request_admitted == 3, "the three calls in flight", 10)
        assert stats.request_success == 0  # each batch takes 800 ms: none answered yet
    finally:
        native.stop()
    for t in threads:
        t.join(30)
    assert len(answers) == 3
    assert all(isinstance(a, np.ndarray) and a.shape == (1, 16) for a in answers), answers


# A client that means harm: the HTTP/2 denial-of-service classes on raw sockets run
# against every runtime's public gRPC port in test_public_grpc.py; here, the limits.


def _h2_server(**limits):
    """A bare GrpcH2Server (no methods) on a loop of its own, for connection limits."""
    import asyncio

    from servekit.endpoints import free_port
    from servekit.grpc.h2 import GrpcH2Server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    h2 = GrpcH2Server({}, "127.0.0.1", free_port(), 1 << 20, **limits)
    asyncio.run_coroutine_threadsafe(h2.start(), loop).result(10)

    class Handle:
        config = ServeConfig(
            (ModelConfig("add_sub"),),
            ServerConfig(host="127.0.0.1", grpc_port=h2.port), runtime="native",
        )  # fmt: skip

        @staticmethod
        def stop() -> None:
            asyncio.run_coroutine_threadsafe(h2.stop(0.1), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    return Handle


def test_no_preface_in_time_idle_connections_and_too_many_connections_are_closed():
    handle = _h2_server(handshake_timeout_s=0.3, idle_timeout_s=0.5, max_connections=2)
    try:
        host, port = address(handle).rsplit(":", 1)
        silent = socket.create_connection((host, int(port)), timeout=10)  # says nothing
        start = time.perf_counter()
        while silent.recv(1 << 16):
            pass
        assert time.perf_counter() - start < 5
        silent.close()
        with RawH2(handle) as idle:
            assert idle.goaway() == (0, "idle")
        with RawH2(handle) as first, RawH2(handle) as second, RawH2(handle) as third:
            assert third.goaway() == (11, "too many connections")
            first.send(PING, 0, 0, b"stillhere")  # the first two are still served
            second.send(PING, 0, 0, b"stillhere")
    finally:
        handle.stop()


def test_a_peer_that_never_reads_its_replies_is_paused_not_buffered():
    """PINGs whose ACKs are never read: with the control budget out of the way, the
    server stops reading the peer once its unsent replies pass the limit."""
    from servekit.store import rss_bytes

    handle = _h2_server(control=(10**9, 1e9), max_unsent_bytes=256 * 1024)
    try:
        before = rss_bytes()
        with RawH2(handle) as raw:
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            raw.sock.settimeout(3)
            sent = 0
            blob = frame(PING, 0, 0, b"pingpong") * 10_000
            try:
                for _ in range(300):  # 51 MB of PINGs, 3 M ACKs were they all answered
                    raw.sock.sendall(blob)
                    sent += len(blob)
            except (TimeoutError, OSError):
                pass  # the server stopped reading: our send buffer filled up
        assert sent < 300 * len(blob)
        assert rss_bytes() - before < 64 * 1024 * 1024
    finally:
        handle.stop()


# servekit's own client (``grpc.h2client``): what the Triton runtimes' gRPC front sends
# tritonserver with, here against servekit's own server and a socket that hangs up.


def _lean_calls(server, *messages: tuple[str, bytes], cancel_after: float | None = None):
    from servekit.grpc.h2client import H2Client

    async def run():
        host, port = address(server).rsplit(":", 1)
        client = H2Client(host, int(port))
        try:
            calls = [client.call(f"/inference.GRPCInferenceService/{m}", b) for m, b in messages]
            if cancel_after is None:
                return await asyncio.gather(*calls)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(calls[0], cancel_after)
            return [await c for c in calls[1:]]
        finally:
            await client.close()

    return asyncio.run(run())


def test_the_lean_client_gets_each_call_its_own_answer(server):
    values = [float(i) for i in range(64)]
    answers = _lean_calls(
        server, *(("ModelInfer", adder_request(v).SerializeToString()) for v in values)
    )
    for value, (code, message, reply) in zip(values, answers, strict=True):
        assert code == 0, message
        assert sums(service_pb2.ModelInferResponse.FromString(reply))[0] == 2 * value


def test_the_lean_client_carries_a_message_larger_than_the_window_and_a_status(server):
    request = service_pb2.ModelInferRequest(model_name="wide")
    data = np.random.default_rng(1).standard_normal((3, WIDE)).astype(np.float32)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=list(data.shape))
    request.raw_input_contents.append(data.tobytes())
    unknown = service_pb2.ModelInferRequest(model_name="nope").SerializeToString()
    (code, _, reply), (bad, message, _) = _lean_calls(
        server, ("ModelInfer", request.SerializeToString()), ("ModelInfer", unknown)
    )
    assert code == 0
    out = service_pb2.ModelInferResponse.FromString(reply).raw_output_contents[0]
    assert np.array_equal(np.frombuffer(out, np.float32).reshape(data.shape), data)
    assert bad == 5 and "nope" in message  # NOT_FOUND, the server's words


def test_a_cancelled_lean_call_is_reset_and_the_connection_goes_on(server):
    (code, message, reply), = _lean_calls(
        server, ("ModelInfer", slow_request().SerializeToString()),
        ("ModelInfer", adder_request(3.0).SerializeToString()), cancel_after=0.05,
    )  # fmt: skip
    assert code == 0, message
    assert sums(service_pb2.ModelInferResponse.FromString(reply))[0] == 6.0


def test_the_lean_client_says_whether_a_call_was_sent():
    """Nobody listening: "failed to connect" (nothing was sent, safe to send again); a
    server that hangs up after reading: the call was sent (it may have run)."""
    from servekit.endpoints import free_port
    from servekit.grpc.h2client import H2Client

    async def run():
        refused = await H2Client("127.0.0.1", free_port()).call("/x/Y", b"")
        got = asyncio.Event()

        async def hang_up(reader, writer):
            await reader.read(100)
            got.set()
            writer.close()

        listener = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        client = H2Client("127.0.0.1", port)
        dropped = await client.call("/x/Y", b"abc")
        await client.close()
        listener.close()
        return refused, dropped, got.is_set()

    refused, dropped, read = asyncio.run(run())
    assert refused[0] == 14 and "failed to connect" in refused[1], refused
    assert read and dropped[0] == 14 and "with the call sent" in dropped[1], dropped
