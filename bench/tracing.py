"""What tracing costs: server CPU per request with ``[server.tracing]`` absent (off), at 1 %
and at 100 % of requests traced, on the native and triton runtimes.

    python bench/tracing.py --out bench/results/tracing.json

add_sub (no work, so the serving path's own cost shows), max batch 8, one instance.
Eight closed-loop tritonclient HTTP clients send ``--requests`` requests each, every one
with a ``traceparent`` of its own. Spans go to an OTLP/HTTP sink in another process,
which counts them. The server runs as ``servekit serve`` in its own process; its CPU is
its process tree's (tritonserver and its stubs included) over the run, divided by the
requests answered.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import tritonclient.http as httpclient

from servekit.bench.cpu import tree_cpu_s
from servekit.bench.report import machine
from servekit.bench.served import clients, cost_row, serve_process
from servekit.endpoints import free_port
from servekit.zoo.tiny import build_add_sub

CONFIG = """
runtime = "{runtime}"
[server]
host = "127.0.0.1"
http_port = {http}
grpc_port = {grpc}
metrics_port = {metrics}
{tracing}
[[models]]
source = "{source}"
name = "add_sub"
instances = 1
threads = 1
[models.batching]
max_batch_size = 8
"""

SINK = """
import http.server, sys
spans = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        global spans
        self.rfile.read(int(self.headers["Content-Length"]))
        spans += 1
        self.send_response(200); self.end_headers()
    def do_GET(self):
        body = str(spans).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
"""An OTLP/HTTP sink: takes every export, counts the exports (``GET``)."""


def run(
    runtime: str, source: Path, rate: float | None, sink: int, requests: int, folder: Path
) -> dict:
    http, grpc, metrics = free_port(), free_port(), free_port()
    tracing = (
        ""
        if rate is None
        else f'[server.tracing]\nendpoint = "http://127.0.0.1:{sink}/v1/traces"\nrate = {rate}\n'
    )
    config = folder / f"{runtime}-{rate}.toml"
    config.write_text(CONFIG.format(runtime=runtime, http=http, grpc=grpc, metrics=metrics,
                                    tracing=tracing, source=source))  # fmt: skip
    url = f"127.0.0.1:{http}"
    with serve_process(config, f"http://{url}", "add_sub") as server:
        x = np.ones((1, 16), np.float32)

        def client(k: int) -> list[float]:
            mine: list[float] = []
            with httpclient.InferenceServerClient(url) as c:
                inputs = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
                for i in inputs:
                    i.set_data_from_numpy(x)
                for _ in range(requests):
                    header = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
                    start = time.perf_counter()
                    c.infer("add_sub", inputs, headers={"traceparent": header})
                    mine.append(time.perf_counter() - start)
            return mine

        for _ in range(2):  # warm: the first requests of a new server cost more
            client(0)
        before = tree_cpu_s(server.pid)
        latencies, wall = clients(8, client)
        cpu = tree_cpu_s(server.pid) - before
    return {
        "runtime": runtime,
        "traced": "off" if rate is None else f"{rate:.0%}",
        **cost_row(latencies, wall, cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="per client")
    parser.add_argument("--runtimes", default="native,triton")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sink_port = free_port()
    sink = subprocess.Popen([sys.executable, "-c", SINK, str(sink_port)])
    rows = []
    try:
        time.sleep(0.5)
        with tempfile.TemporaryDirectory() as tmp:
            source = Path(tmp) / "add_sub.onnx"
            onnx.save(build_add_sub(), source)
            for round_ in range(args.rounds):
                for runtime in args.runtimes.split(","):
                    for rate in (None, 0.01, 1.0):
                        row = run(runtime, source, rate, sink_port, args.requests, Path(tmp))
                        row["round"] = round_ + 1
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{sink_port}/") as r:
            exports = int(r.read())
    finally:
        sink.kill()
        sink.wait()
    result = {"machine": machine(), "rows": rows, "exports_received": exports}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
