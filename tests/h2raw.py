"""HTTP/2 spoken by hand over a raw socket, for the gRPC tests: frames built here, headers
through the ``hpack`` package, and the attacks a client that means harm makes (rapid
reset, control-frame floods) while a polite client calls on another connection."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import hpack
import numpy as np
from tritonclient.grpc import service_pb2

from servekit.grpc.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    frame,
    grpc_message,
    next_frame,
)  # fmt: skip

INFER = "/inference.GRPCInferenceService/ModelInfer"


def address(server) -> str:
    return server.config.server.grpc_url.removeprefix("grpc://")


def adder_request(value: float) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="adder")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(np.full((1, 16), value, np.float32).tobytes())
    return request


def sums(response: service_pb2.ModelInferResponse) -> np.ndarray:
    index = [o.name for o in response.outputs].index("OUTPUT0")
    return np.frombuffer(response.raw_output_contents[index], np.float32)


class RawH2:
    """A hand-driven HTTP/2 client: frames out, frames in, nothing automatic but PING's ACK."""

    def __init__(self, server, settings_payload: bytes = b"", preface: bytes = PREFACE) -> None:
        host, port = address(server).rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.sock.sendall(preface + frame(SETTINGS, 0, 0, settings_payload))
        self.encoder, self.decoder = hpack.Encoder(), hpack.Decoder()
        self.buffer = b""

    def send(self, kind: int, flags: int, stream: int, payload: bytes = b"") -> None:
        self.sock.sendall(frame(kind, flags, stream, payload))

    def call(
        self, stream: int, body: bytes, *, path: str = INFER, headers=(), end: bool = True
    ) -> None:
        block = self.encoder.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "test"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *headers,
            ]
        )
        self.send(HEADERS, END_HEADERS, stream, block)
        self.send(DATA, END_STREAM if end else 0, stream, body)

    def add(self, stream: int, value: float) -> float:
        """An adder call on this connection: the sum it answers (its status must be OK)."""
        self.call(stream, grpc_message(adder_request(value).SerializeToString()))
        _, answer, trailers = self.response(stream)
        assert trailers["grpc-status"] == "0", trailers
        return float(sums(service_pb2.ModelInferResponse.FromString(answer[5:]))[0])

    def frame(self) -> tuple[int, int, int, bytes] | None:
        """The next frame, or None once the server has closed the connection."""
        while (whole := next_frame(self.buffer)) is None:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        kind, flags, stream, payload, end = whole
        self.buffer = self.buffer[end:]
        return kind, flags, stream, payload

    def response(self, stream: int, on_data=None) -> tuple[dict, bytes, dict]:
        """(headers, message bytes, trailers) of one call; ``on_data(frame)`` sees each DATA."""
        headers: dict = {}
        body = b""
        while True:
            got = self.frame()
            assert got is not None, "the server closed the connection"
            kind, flags, sid, payload = got
            if kind == HEADERS:
                decoded = dict(self.decoder.decode(payload))
                if sid == stream and flags & END_STREAM:
                    return headers, body, decoded
                if sid == stream:
                    headers = decoded
            elif kind == DATA and sid == stream:
                body += payload
                if on_data is not None:
                    on_data(payload)
            elif kind == PING and not flags & 1:
                self.send(PING, 1, 0, payload)

    def goaway(self) -> tuple[int, str] | None:
        """The error code and reason of the server's GOAWAY, once it has closed."""
        found = None
        while (got := self.frame()) is not None:
            if got[0] == GOAWAY:
                found = int.from_bytes(got[3][4:8], "big"), got[3][8:].decode()
        return found

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawH2:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def blast(server, blob: bytes, rounds: int, results: list) -> None:
    """Connections that each send ``blob`` (never reading while sending) and then read
    until the server closes: the GOAWAY each got."""
    for _ in range(rounds):
        with RawH2(server) as raw:
            with contextlib.suppress(OSError):  # the server hung up on us mid-blast
                raw.sock.sendall(blob)
            try:
                results.append(raw.goaway())
            except OSError:
                results.append("reset")


def attack_while_calling(live, server, blob: bytes, rounds: int = 5) -> tuple[list, float]:
    """Attack from other connections while a polite client calls: the GOAWAYs the
    attacker got and the polite client's slowest call."""
    results: list = []
    attacker = threading.Thread(target=blast, args=(server, blob, rounds, results))
    attacker.start()
    slowest = 0.0
    while attacker.is_alive():
        start = time.perf_counter()
        assert sums(live.ModelInfer(adder_request(1.0), timeout=30))[0] == 2.0
        slowest = max(slowest, time.perf_counter() - start)
    attacker.join()
    return results, slowest


def rapid_reset(streams: int = 5000) -> bytes:
    """CVE-2023-44487: ``streams`` calls opened and reset at once, on one connection."""
    encoder = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "x"),
               ("content-type", "application/grpc")]  # fmt: skip
    cancel = (8).to_bytes(4, "big")
    return b"".join(
        frame(HEADERS, END_HEADERS, sid, encoder.encode(headers))
        + frame(RST_STREAM, 0, sid, cancel)
        for sid in range(1, 2 * streams, 2)
    )


def opened_stream() -> bytes:
    """A call's headers on stream 1, nothing more: a stream to send frames on."""
    return frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(
        [(":method", "POST"), (":scheme", "http"), (":path", INFER), (":authority", "x"),
         ("content-type", "application/grpc")]))  # fmt: skip
