"""Connection limits from ``[server]``, on both of servekit's protocols end to end (the
native runtime): a cap on connections, HTTP/1.1's keep-alive (a client that never
finishes its headers included), and gRPC's preface deadline and idle timeout; and the
runtimes whose ports are not servekit's refuse them by name."""

from __future__ import annotations

import socket
import time

import pytest

from servekit import ModelConfig, ServeConfig, ServerConfig
from servekit.native import NativeServer

LIMITS = dict(max_connections=3, keep_alive_s=0.6, grpc_handshake_timeout_s=0.3,
              grpc_idle_timeout_s=0.6)  # fmt: skip


@pytest.fixture(scope="module")
def native(add_sub_path):
    config = ServeConfig(
        (ModelConfig(str(add_sub_path), "adder"),), ServerConfig(exit_timeout_s=2, **LIMITS),
        runtime="native",
    ).on_loopback()  # fmt: skip
    with NativeServer(config) as server:
        yield server


def connect(server, port: int) -> socket.socket:
    return socket.create_connection((server.config.server.client_host, port), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before it closed ``sock``; fails if it is still open later."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except TimeoutError:
        pytest.fail(f"still open after {seconds} s")
    finally:
        sock.close()
    return got


def live(server) -> bytes:
    with connect(server, server.config.server.http_port) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return closed_within(s, 10)


def test_one_connection_too_many_gets_a_503_and_idle_ones_are_closed(native):
    http = native.config.server.http_port
    held = [connect(native, http) for _ in range(3)]
    time.sleep(0.1)
    refused = closed_within(connect(native, http), 5)
    assert refused.startswith(b"HTTP/1.1 503") and b"too many connections" in refused
    for s in held:  # idle past keep_alive_s: closed by the server
        assert closed_within(s, 5) == b""
    assert live(native).startswith(b"HTTP/1.1 200")


def test_a_client_that_never_finishes_its_headers_is_closed(native):
    with connect(native, native.config.server.http_port) as s:
        start = time.perf_counter()
        s.sendall(b"POST /v2/models/adder/infer HTTP/1.1\r\nhost: x\r\n")
        try:
            for _ in range(20):  # a header byte every 0.2 s: slowloris
                time.sleep(0.2)
                s.sendall(b"x")
        except OSError:
            pass
        closed_within(s, 5)
        assert time.perf_counter() - start < 4.5
    assert live(native).startswith(b"HTTP/1.1 200")


def test_grpc_closes_a_silent_connection_and_an_idle_one(native):
    grpc = native.config.server.grpc_port
    assert b"no HTTP/2 preface in time" in closed_within(connect(native, grpc), 5)
    with connect(native, grpc) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes((0, 0, 0, 4, 0, 0, 0, 0, 0)))
        got = closed_within(s, 5)
    assert got.endswith(b"idle")  # the GOAWAY's reason, the last frame sent


@pytest.mark.parametrize(
    "runtime, knob, front, why",
    [("ray", "max_connections", True, "Ray's HTTP proxy keeps its own connections"),
     ("triton", "grpc_idle_timeout_s", False, "the public gRPC port is tritonserver's"),
     ("pytriton", "grpc_handshake_timeout_s", False, "the public gRPC port is tritonserver's")],
)  # fmt: skip
def test_runtimes_whose_ports_are_not_servekits_refuse_the_knobs_by_name(runtime, knob, front, why):
    server = ServerConfig(**{knob: 7}, front=front)
    config = ServeConfig((ModelConfig("add_sub"),), server, runtime=runtime)
    with pytest.raises(ValueError, match=f"{knob}.*{why}"):
        config.check()
    if not front:  # with the front (the default) the public gRPC port is servekit's
        ServeConfig((ModelConfig("add_sub"),), ServerConfig(**{knob: 7}), runtime=runtime).check()
    with pytest.raises(ValueError, match="max_connections must be > 0"):
        ServerConfig(max_connections=0)
