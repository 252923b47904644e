"""servekit's HTTP/1.1 server (``servekit.http.h1``): what a client of any HTTP server relies on.

A real server on a free loopback port, raw sockets as clients: answers in order on one
connection, garbage and oversized requests answered (never a dropped server), bodies
over the limit never buffered, idle connections closed, requests in flight answered on
stop.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import wait_until
from servekit.endpoints import free_port
from servekit.http.h1 import H1Server
from servekit.http.messages import Answer, HttpRequest

LIMIT = 1000


async def echo(request: HttpRequest) -> Answer:
    """Answers ``<method> <path>?<query> <body length>``; ``/sleep/<ms>`` waits first."""
    body = request.body
    if request.path.startswith("/sleep/"):
        await asyncio.sleep(int(request.path.rsplit("/", 1)[1]) / 1000)
    text = f"{request.method} {request.path}?{request.query.decode()} {len(body)}"
    return 200, text.encode(), {"x-echo": "1"}


@pytest.fixture()
def server() -> Iterator[H1Server]:
    s = H1Server(echo, "127.0.0.1", free_port(), max_body_bytes=LIMIT, keep_alive_s=1.0).start()
    try:
        yield s
    finally:
        s.stop(5)


def connect(server: H1Server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """``count`` answers (status, body) read off the socket."""
    buf, answers = b"", []
    while len(answers) < count:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return answers
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status == 100:
            continue
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")[1:]
            if line.lower().startswith(b"content-length:")
        )
        while len(buf) < length:
            buf += sock.recv(65536)
        answers.append((status, buf[:length]))
        buf = buf[length:]
    return answers


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def test_pipelined_requests_are_answered_in_order(server):
    with connect(server) as sock:
        sock.sendall(get("/sleep/200") + get("/sleep/0") + get("/a%20b?q=1"))
        answers = read_answers(sock, 3)
    assert [a[1] for a in answers] == [b"GET /sleep/200? 0", b"GET /sleep/0? 0", b"GET /a b?q=1 0"]


def test_a_head_request_is_answered_with_headers_only_and_the_next_answer_follows(server):
    """The answer's content-length is the body's a GET would get, and no body follows it:
    a body there would be read as the start of the next answer on the connection."""
    with connect(server) as sock:
        sock.sendall(get("/g").replace(b"GET", b"HEAD") + get("/g"))
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"GET /g? 0"):
            chunk = sock.recv(65536)
            assert chunk, data
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-length: 10" in head
    assert rest.startswith(b"HTTP/1.1 200") and rest.endswith(b"\r\n\r\nGET /g? 0")


def test_a_chunked_body_reaches_the_app_whole(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        assert read_answers(sock, 1) == [(200, b"POST /c? 11")]


def test_both_content_length_and_transfer_encoding_is_a_400_against_smuggling(server):
    """The two framings disagree on where the body ends (RFC 9112 6.3): refused, closed."""
    with connect(server) as sock:
        sock.sendall(
            b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n"
        )
        answers = read_answers(sock, 2)
    assert [status for status, _ in answers] == [400]
    with connect(server) as sock:
        sock.sendall(get("/alive"))
        assert read_answers(sock, 1) == [(200, b"GET /alive? 0")]


def test_expect_continue_gets_an_interim_answer(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"abc")
        assert read_answers(sock, 1) == [(200, b"POST /e? 3")]


def test_a_body_over_the_limit_is_a_413_and_the_connection_goes_on(server):
    with connect(server) as sock:
        big = b"x" * (LIMIT * 5)
        sock.sendall(
            b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(big) + big
        )
        sock.sendall(b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(big), big) + get("/next"))
        (s1, b1), (s2, b2), (s3, b3) = read_answers(sock, 3)
    assert s1 == s2 == 413 and b"exceeds the limit of 1000" in b1 and b"exceeds" in b2
    assert (s3, b3) == (200, b"GET /next? 0")


def test_a_request_target_over_the_limit_is_a_414(server):
    with connect(server) as sock:
        sock.sendall(get("/" + "a" * 70_000))
        ((status, body),) = read_answers(sock, 1)
    assert status == 414 and b"request target exceeds" in body


def test_headers_over_the_limit_are_a_431(server):
    with connect(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 70_000 + b"\r\n\r\n")
        ((status, body),) = read_answers(sock, 1)
    assert status == 431 and b"exceed" in body


def test_a_malformed_request_is_a_400_and_the_server_serves_on(server):
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        ((status, body),) = read_answers(sock, 1)
        assert status == 400 and b"malformed" in body
        assert sock.recv(10) == b""  # and that connection is closed
    with connect(server) as sock:
        sock.sendall(get("/ok"))
        assert read_answers(sock, 1) == [(200, b"GET /ok? 0")]


def test_an_idle_connection_is_closed_after_keep_alive(server):
    with connect(server) as sock:
        sock.sendall(get("/x"))
        assert read_answers(sock, 1)[0][0] == 200
        start = time.monotonic()
        assert sock.recv(10) == b""
        assert time.monotonic() - start < 5


def test_stop_answers_the_requests_in_flight():
    s = H1Server(echo, "127.0.0.1", free_port()).start()
    sock = socket.create_connection((s.host, s.port), timeout=10)
    sock.sendall(get("/sleep/500"))
    wait_until(lambda: any(c.busy for c in s.connections), "the request in flight", 10)
    stopper = threading.Thread(target=s.stop, args=(5,))
    stopper.start()
    assert read_answers(sock, 1) == [(200, b"GET /sleep/500? 0")]
    stopper.join()
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection((s.host, s.port), timeout=2)


def test_an_app_error_is_a_500_for_that_request_only():
    async def app(request: HttpRequest) -> Answer:
        if request.path == "/boom":
            raise RuntimeError("boom")
        return await echo(request)

    s = H1Server(app, "127.0.0.1", free_port()).start()
    try:
        with socket.create_connection((s.host, s.port), timeout=10) as sock:
            sock.sendall(get("/boom") + get("/fine"))
            (s1, b1), (s2, b2) = read_answers(sock, 2)
        assert s1 == 500 and "RuntimeError" in json.loads(b1)["error"]
        assert (s2, b2) == (200, b"GET /fine? 0")
    finally:
        s.stop(5)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=1, max_size=300))
def test_any_bytes_leave_the_server_serving(server, garbage):
    with connect(server) as sock:
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(65536):
            pass
    with connect(server) as sock:
        sock.sendall(get("/alive"))
        assert read_answers(sock, 1) == [(200, b"GET /alive? 0")]


def test_a_fast_path_error_is_a_500_for_that_request_only():
    def fast(method, path, headers, body, reply) -> bool:
        if path == "/fast-boom":
            raise RuntimeError("boom")
        if path == "/fast":
            reply(200, b"fast", {})
            return True
        return False

    s = H1Server(echo, "127.0.0.1", free_port(), fast=fast).start()
    try:
        with socket.create_connection((s.host, s.port), timeout=10) as sock:
            sock.sendall(get("/fast-boom") + get("/fast") + get("/slow"))
            (s1, b1), (s2, b2), (s3, b3) = read_answers(sock, 3)
        assert s1 == 500 and "RuntimeError" in json.loads(b1)["error"]
        assert (s2, b2, s3, b3) == (200, b"fast", 200, b"GET /slow? 0")
    finally:
        s.stop(5)
