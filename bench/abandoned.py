"""Clients that leave (issue 71): rows the device runs for requests nobody reads.

300 clients each send one request for ``sim_t4`` (max batch 32, one instance), wait 30 ms
and close their connections without reading (half closed, half reset), as clients with a
timeout do; the model's own statistics then say how many rows the device ran, and
``servekit_requests_abandoned_total`` where each was left. Each runtime serves in a
process of its own (``servekit serve --config``); Ray through Ray Serve's proxy.

    .venv/bin/python bench/abandoned.py --out bench/results/abandoned.json
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import struct
import time
import urllib.request
from pathlib import Path

import numpy as np

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench.payload import raw_http_infer
from servekit.bench.process import ServerProcess
from servekit.front.demand import parse_counters

RUNTIMES = ("native", "pytriton", "triton", "ray")


def leave(port: int, clients: int, wait_s: float) -> None:
    body = raw_http_infer("m", {"input": np.zeros((1, 64, 64, 3), np.float32)})
    opened: list[tuple[float, int, socket.socket]] = []
    for i in range(clients):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(body)
        opened.append((time.monotonic() + wait_s, i, s))
        while opened and opened[0][0] <= time.monotonic():
            _close(*opened.pop(0)[1:])
    for due, i, s in opened:
        time.sleep(max(0.0, due - time.monotonic()))
        _close(i, s)


def _close(i: int, s: socket.socket) -> None:
    if i % 2:  # a reset
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def figures(metrics: str) -> dict[str, float]:
    """Model m's rows and answers (``parse_counters``, the front's own reader of Triton's
    names) and its ``servekit_requests_abandoned_total`` by where it was left."""
    with urllib.request.urlopen(metrics, timeout=10) as r:
        text = r.read().decode()
    mine = [c for (model, _), c in parse_counters(text).items() if model == "m"]
    out = {"rows": sum(c.rows for c in mine), "answered": sum(c.requests for c in mine)}
    for where in ("queued", "forwarded", "running"):
        pattern = rf'^servekit_requests_abandoned_total\{{[^}}]*model="m"[^}}]*where="{where}"[^}}]*\}} (\S+)$'
        out[where] = sum(float(v) for v in re.findall(pattern, text, re.M))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--wait-ms", type=float, default=30.0)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    path = zoo.build("sim_t4", Path.home() / ".cache" / "servekit")
    results = {}
    for runtime in args.runtimes.split(","):
        model = ModelConfig(str(path), "m", batching=BatchingPolicy(max_batch_size=32))
        config = ServeConfig((model,), ServerConfig(exit_timeout_s=5), runtime=runtime)
        config = config.on_loopback()
        metrics = (
            f"{config.server.http_url}/metrics"
            if runtime in ("native", "ray")
            else config.server.metrics_url
        )
        with ServerProcess(config) as server:
            server.wait_ready(["m"])
            before = figures(metrics)
            leave(config.server.http_port, args.clients, args.wait_ms / 1e3)
            time.sleep(5)  # every batch it ran has ended
            after = figures(metrics)
        got = {k: after[k] - before[k] for k in after}
        results[runtime] = got
        print(
            f"{runtime:>9}: {got['rows']:.0f} rows run for {args.clients} clients that left "
            f"(abandoned: queued {got['queued']:.0f}, forwarded {got['forwarded']:.0f}, "
            f"running {got['running']:.0f})",
            flush=True,
        )
    if args.out is not None:
        meta = {"date": time.strftime("%Y-%m-%d"), "clients": args.clients, "wait_ms": args.wait_ms}
        args.out.write_text(json.dumps({"meta": meta, "runtimes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
