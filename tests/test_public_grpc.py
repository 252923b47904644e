"""Every runtime's public gRPC port under attack: native, PyTriton and Triton serve it with
servekit's own HTTP/2 server (on the Triton runtimes in front of tritonserver's gRPC on
loopback, ``front.relay``), each in a ``servekit serve`` process of its own. Ray has no
gRPC port.

For each HTTP/2 denial-of-service class, sent from raw sockets while a polite client
calls on another connection: the attacker gets its GOAWAY, the polite calls are
answered, no process of the server's is replaced (tritonserver is never reached), and
the server's processes hold no more memory and no more descriptors than before.

Triton's ``ModelStreamInfer`` too, on each: tritonclient's streams from eight clients at
once (each answer carrying its request's id, a bad request answered with its error and
the stream going on), ``stop_stream(cancel_requests=True)``, and the stream attacks: a
flood of messages never answered fast enough, and streams opened and abandoned."""

from __future__ import annotations

import socket
import time

import numpy as np
import onnx
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import each_client, wait_until  # noqa: E402
from h2raw import (  # noqa: E402
    RawH2,
    adder_request,
    address,
    attack_while_calling,
    opened_stream,
    rapid_reset,
    sums,
)
from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig  # noqa: E402
from servekit.bench.compare import ServerProcess  # noqa: E402
from servekit.bench.cpu import descendants, tree_fds, tree_rss_bytes  # noqa: E402
from servekit.grpc.frames import (  # noqa: E402
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    SETTINGS,
    frame,
    grpc_message,
)
from servekit.zoo.tiny import build_simulated  # noqa: E402

RUNTIMES = ["native", "pytriton", "triton"]


WIDE = 100_000
"""The wide model's row: 400 KB, more than tritonserver's HTTP/2 window."""


@pytest.fixture(scope="module", params=RUNTIMES)
def server(request, add_sub_path, tmp_path_factory):
    wide = tmp_path_factory.mktemp("wide") / "wide.onnx"
    identity = build_simulated("wide", 0, 0, width=WIDE)
    del identity.metadata_props[:]  # no device profile: ONNX Runtime runs its Identity
    onnx.save(identity, wide)
    policy = BatchingPolicy(max_batch_size=8, max_queue_delay_us=200)
    config = ServeConfig(
        (
            ModelConfig(str(add_sub_path), "adder", batching=policy, threads=1),
            ModelConfig(str(wide), "wide", batching=policy, threads=1, image=False),
        ),
        ServerConfig(exit_timeout_s=2, grpc_handshake_timeout_s=1.0, grpc_idle_timeout_s=30.0),
        runtime=request.param,
    ).on_loopback()
    with ServerProcess(config) as served:
        served.wait_ready(["adder", "wide"])
        yield served


def held(server) -> tuple[set[int], int, int]:
    """The server's processes (tritonserver and its stubs included), their resident
    memory and their open descriptors, less shared-memory blocks: PyTriton's tensor store
    keeps the blocks a burst of batches made it add, a pool of its own, not a leak."""
    return (
        set(descendants(server.pid)),
        tree_rss_bytes(server.pid),
        tree_fds(server.pid, skip=("/dev/shm/",)),
    )


@pytest.fixture
def live(server):
    """A polite channel, opened before the attack and checked after it; the server's
    processes must be the same ones after, and hold what they held."""
    channel = grpc.insecure_channel(address(server))
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    assert sums(stub.ModelInfer(adder_request(1.0), timeout=30))[0] == 2.0
    pids, rss, fds = held(server)
    yield stub
    assert sums(stub.ModelInfer(adder_request(2.0), timeout=30))[0] == 4.0
    channel.close()
    after = held(server)
    assert after[0] == pids, "a process of the server's was replaced"
    assert after[1] - rss < 64 * 1024 * 1024, (rss, after[1])
    wait_until(lambda: held(server)[2] <= fds, "the attack's descriptors closed", 10)


def test_tensors_larger_than_the_window_pass_both_ways(server):
    """1.2 MB in and out: past tritonserver's flow-control windows on the Triton runtimes
    (the front's client waits for its WINDOW_UPDATEs), and servekit's own on native.
    Not under ``live``: PyTriton keeps shared memory open for tensors this large."""
    client = grpcclient.InferenceServerClient(address(server))
    try:
        data = np.random.default_rng(0).standard_normal((3, WIDE)).astype(np.float32)
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        assert np.array_equal(client.infer("wide", [tensor]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def test_a_malformed_call_gets_a_status_naming_it(live, server):
    with RawH2(server) as raw:
        raw.call(1, grpc_message(b"\xff\xff\xff"))
        _, _, trailers = raw.response(1)
        assert trailers["grpc-status"] == "3", trailers  # INVALID_ARGUMENT
        assert "not a ModelInferRequest" in trailers["grpc-message"], trailers
        assert raw.add(3, 2.5) == 5.0  # and the connection goes on


def test_a_call_with_too_many_headers_is_refused_and_its_connection_goes_on(live, server):
    """Over the 64 KiB the server advertises (SETTINGS_MAX_HEADER_LIST_SIZE), a call is
    answered RESOURCE_EXHAUSTED, as grpc-core answers it; its block is still decoded, so
    HPACK's tables stay in step and the calls sharing the connection are answered."""
    with RawH2(server) as raw:
        raw.call(1, grpc_message(adder_request(1.0).SerializeToString()), end=False)
        raw.call(3, grpc_message(adder_request(2.0).SerializeToString()),
                 headers=[("x-big", "b" * 100_000)])  # fmt: skip
        _, _, trailers = raw.response(3)
        assert trailers["grpc-status"] == "8", trailers  # RESOURCE_EXHAUSTED
        assert "exceeds the limit of 65536 bytes" in trailers["grpc-message"], trailers
        assert "the largest: 'x-big', 100005 bytes" in trailers["grpc-message"], trailers
        raw.send(DATA, END_STREAM, 1, b"")  # the call begun before it ends now
        _, answer, trailers = raw.response(1)
        assert trailers["grpc-status"] == "0", trailers
        assert sums(service_pb2.ModelInferResponse.FromString(answer[5:]))[0] == 2.0
        assert raw.add(5, 2.5) == 5.0

    url = address(server)
    x = np.full((1, 16), 1.0, np.float32)

    def client(k: int) -> None:  # eight clients, one of them sending 100 KB of metadata
        with grpcclient.InferenceServerClient(url) as c:
            inputs = [grpcclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
            for tensor in inputs:
                tensor.set_data_from_numpy(x * k)
            for _ in range(10):
                if k == 0:
                    with pytest.raises(InferenceServerException, match="exceeds the limit"):
                        c.infer("adder", inputs, headers={"x-big": "b" * 100_000})
                else:
                    got = c.infer("adder", inputs).as_numpy("OUTPUT0")
                    assert np.array_equal(got, x * 2 * k)

    each_client(client)


def test_rapid_reset(live, server):
    """CVE-2023-44487: calls opened and reset at once, thousands of times a second."""
    results, slowest = attack_while_calling(live, server, rapid_reset())
    assert results and all(r == (11, "too many RST_STREAM frames") for r in results), results
    assert slowest < 1.0, slowest  # the issue asks 0.5 s; 1 s leaves room for CI's noise


@pytest.mark.parametrize(
    "flood, why",
    [(frame(PING, 0, 0, b"pingpong") * 200_000, "PING"),
     (frame(SETTINGS, 0, 0, b"") * 200_000, "SETTINGS"),
     (opened_stream() + frame(DATA, 0, 1, b"") * 200_000, "empty DATA")],
    ids=["ping", "settings", "empty-data"],
)  # fmt: skip
def test_control_frame_floods(live, server, flood, why):
    results, slowest = attack_while_calling(live, server, flood, rounds=3)
    assert results and all(r == (11, f"too many {why} frames") for r in results), results
    assert slowest < 1.0, slowest


def test_continuation_flood_and_hpack_bomb(live, server):
    """CVE-2024-27316: a header block that never ends; and one that decodes to far more
    than it weighs (one large header repeated from HPACK's table)."""
    endless = frame(HEADERS, 0, 1, b"") + frame(CONTINUATION, 0, 1, bytes(16_000)) * 100
    results, _ = attack_while_calling(live, server, endless, rounds=3)
    assert results and all(
        r is not None and r[0] == 1 and "header block over" in r[1] for r in results
    ), results

    with RawH2(server) as raw:  # a 4 KB header once, then indexed 16,000 times
        big = raw.encoder.encode([("x-big", "b" * 4000)])
        again = raw.encoder.encode([("x-big", "b" * 4000)])
        raw.sock.sendall(frame(HEADERS, END_HEADERS, 1, big))
        raw.sock.sendall(frame(HEADERS, END_HEADERS, 3, again * 16_000))
        got = raw.goaway()
    assert got is not None and got[0] in (1, 9), got  # PROTOCOL or COMPRESSION error


def test_slow_and_idle_connections_and_a_thousand_streams(live, server):
    """Zero window (replies never let out), a thousand calls begun and never finished, and
    a connection that never sends its preface (closed after the config's handshake
    timeout): each is bounded, and the polite client is answered meanwhile."""
    with RawH2(server, settings_payload=(4).to_bytes(2, "big") + bytes(4)) as zero:
        # A real call: its answer's DATA waits for a window that never opens.
        zero.call(1, grpc_message(adder_request(1.0).SerializeToString()))
        with RawH2(server) as many:
            for sid in range(1, 2001, 2):
                many.call(sid, b"\x00\x00\x00\x00\x10", end=False)  # 16 bytes promised
            # Answered while they hold on (a server stuck on them answers no one):
            # within the call's own deadline, not a speed bound (a busy host varies).
            assert sums(live.ModelInfer(adder_request(3.0), timeout=10))[0] == 6.0
    host, port = address(server).rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as silent:
        start = time.perf_counter()
        while silent.recv(1 << 16):  # until the server hangs up
            pass
        assert time.perf_counter() - start < 5


STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _tensors(value: float, width: int = 16) -> list:

    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, width], "FP32")
        tensor.set_data_from_numpy(np.full((1, width), value, np.float32))
        tensors.append(tensor)
    return tensors


def test_tritonclient_streams_from_eight_clients_answer_every_request_by_id(live, server):
    """Each client streams 25 requests, one of them malformed (INPUT0 of 3 values) and one
    to a model that does not exist: every request is answered once, by id, the two with
    errors naming what was wrong, and each stream goes on past them."""
    import queue

    def client(k: int) -> None:
        answers: queue.Queue = queue.Queue()
        c = grpcclient.InferenceServerClient(address(server))
        try:
            c.start_stream(callback=lambda result, error: answers.put((result, error)))
            for i in range(25):
                rid = f"{k}-{i}"
                if i == 7:
                    tensors = _tensors(1.0)
                    tensors[0] = grpcclient.InferInput("INPUT0", [1, 3], "FP32")
                    tensors[0].set_data_from_numpy(np.ones((1, 3), np.float32))
                    c.async_stream_infer("adder", tensors, request_id=rid)
                elif i == 13:
                    c.async_stream_infer("nope", _tensors(1.0), request_id=rid)
                else:
                    c.async_stream_infer("adder", _tensors(float(i)), request_id=rid)
            got = {}
            errors = []
            for _ in range(25):
                result, error = answers.get(timeout=60)
                if error is not None:
                    errors.append(str(error))
                else:
                    response = result.get_response()
                    assert response.id not in got, f"{response.id} answered twice"
                    got[response.id] = result.as_numpy("OUTPUT0")
            assert sorted(got) == sorted(f"{k}-{i}" for i in range(25) if i not in (7, 13))
            for rid, out in got.items():
                i = int(rid.split("-")[1])
                assert out.shape == (1, 16) and np.all(out == 2.0 * i), (rid, out)
            assert len(errors) == 2, errors
            bad = next(e for e in errors if "INPUT0" in e)
            assert "16" in bad and "3" in bad, bad  # expected and got
            assert any("nope" in e for e in errors), errors
            c.stop_stream()
        finally:
            c.close()

    each_client(client)


def test_stop_stream_cancelling_its_requests_leaves_the_server_serving(live, server):

    c = grpcclient.InferenceServerClient(address(server))
    try:
        answered = []
        c.start_stream(callback=lambda result, error: answered.append(error is None))
        for i in range(50):
            c.async_stream_infer("adder", _tensors(float(i)), request_id=str(i))
        c.stop_stream(cancel_requests=True)
        c.start_stream(callback=lambda result, error: answered.append(result))
        c.async_stream_infer("adder", _tensors(4.0), request_id="after")
        wait_until(lambda: answered and not isinstance(answered[-1], bool), "the next stream", 30)
        assert answered[-1].as_numpy("OUTPUT0")[0, 0] == 8.0
        c.stop_stream()
    finally:
        c.close()


def _stream_messages(count: int) -> bytes:
    message = grpc_message(adder_request(1.0).SerializeToString())
    return b"".join(frame(DATA, 0, 1, message) for _ in range(count))


def test_a_stream_flooded_and_never_read_is_paused_not_buffered(live, server):
    """One stream, its responses never read (its window never opened past the default),
    sent adder requests as fast as the socket takes them: the server stops reading it,
    the polite client is answered meanwhile, and memory stays bounded (``live``)."""
    with RawH2(server) as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        raw.sock.settimeout(3)
        raw.call(1, b"", path=STREAM, end=False)
        blob = _stream_messages(1000)  # about 200 KB
        sent = 0
        try:
            for _ in range(1000):
                raw.sock.sendall(blob)
                sent += len(blob)
        except (TimeoutError, OSError):
            pass  # the server stopped reading us
        assert sent < 1000 * len(blob), "the server read 200 MB of a stream it cannot answer"
        # Answered while the flood is held (within the call's own deadline, as above).
        assert sums(live.ModelInfer(adder_request(3.0), timeout=10))[0] == 6.0


def test_streams_opened_and_abandoned_are_closed_with_their_connection(live, server):
    """A hundred streams, each sent one request and never read or ended, then the
    connection dropped: what they held is let go (``live`` checks memory and descriptors)."""
    for _ in range(3):
        with RawH2(server) as raw:
            message = grpc_message(adder_request(1.0).SerializeToString())
            for sid in range(1, 201, 2):
                raw.call(sid, message, path=STREAM, end=False)
            assert sums(live.ModelInfer(adder_request(2.0), timeout=30))[0] == 4.0
