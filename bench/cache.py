"""The response cache's cost and gain: server CPU per request on the native runtime with
no cache, and with the cache (local, or a real redis-server) at 0 %, 50 % and 99 % hits.

    python bench/cache.py --out bench/results/cache.json

The model is add_sub passing INPUT0 through ``--heavy`` 1024x1024 identity MatMuls first
(the same answers, a few ms of work a request: ``build_add_sub(heavy=...)``). Eight
closed-loop tritonclient HTTP clients send ``--requests`` requests each; a request is one
of 16 hot inputs (answered before, primed) with the hit share's probability, else an input
never sent before. The server runs as ``servekit serve`` in its own process; its CPU is
its process tree's (plus redis-server's, with Redis) over the run, divided by the
requests answered. The hit share read back from the server's metrics is shown beside.
"""

from __future__ import annotations

import argparse
import json
import subprocess
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
runtime = "native"
[server]
host = "127.0.0.1"
http_port = {http}
grpc_port = {grpc}
metrics_port = {metrics}
{cache}
[[models]]
source = "{source}"
name = "add_sub"
instances = 1
threads = 1
response_cache = {cached}
[models.batching]
max_batch_size = 8
"""


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def run(source: Path, store: str, hit: float, requests: int, folder: Path) -> dict:
    http, grpc, metrics = free_port(), free_port(), free_port()
    redis = None
    cache = ""
    if store == "redis":
        port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        cache = f'cache = {{ redis = {{ url = "redis://127.0.0.1:{port}/0" }} }}'
    elif store == "local":
        cache = "cache = { local = { size_mb = 256 } }"
    config = folder / f"{store}-{hit}.toml"
    config.write_text(CONFIG.format(http=http, grpc=grpc, metrics=metrics, cache=cache,
                                    source=source, cached=str(store != "none").lower()))  # fmt: skip
    url = f"127.0.0.1:{http}"
    try:
        with serve_process(config, f"http://{url}", "add_sub") as server:
            hot = [np.full((1, 16), 1000 + k, np.float32) for k in range(16)]

            def send(c: httpclient.InferenceServerClient, x: np.ndarray) -> None:
                inputs = [httpclient.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
                for i in inputs:
                    i.set_data_from_numpy(x)
                c.infer("add_sub", inputs)

            with httpclient.InferenceServerClient(url) as c:
                for x in hot:
                    send(c, x)  # primed: each hot input answered once

            def client(k: int) -> list[float]:
                rng = np.random.default_rng(k)
                mine: list[float] = []
                with httpclient.InferenceServerClient(url) as c:
                    for i in range(requests):
                        if rng.random() < hit:
                            x = hot[int(rng.integers(16))]
                        else:
                            x = np.full((1, 16), -(k * requests + i + 1), np.float32)  # never sent
                        start = time.perf_counter()
                        send(c, x)
                        mine.append(time.perf_counter() - start)
                return mine

            pids = [server.pid] + ([redis.pid] if redis else [])
            before = sum(tree_cpu_s(p) for p in pids)
            latencies, wall = clients(8, client)
            cpu = sum(tree_cpu_s(p) for p in pids) - before
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
        hits = metric(text, "nv_cache_num_hits_per_model")
        misses = metric(text, "nv_cache_num_misses_per_model")
        return {
            "store": store,
            "hit_share_asked": hit,
            "hit_share_seen": round(hits / (hits + misses), 3) if hits + misses else None,
            **cost_row(latencies, wall, cpu),
        }
    finally:
        if redis is not None:
            redis.kill()
            redis.wait(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=250, help="per client")
    p.add_argument("--heavy", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "add_sub_heavy.onnx"
        onnx.save(build_add_sub(heavy=a.heavy), source)
        cases = [("none", 0.0)] + [(s, h) for s in ("local", "redis") for h in (0.0, 0.5, 0.99)]
        for store, hit in cases:
            point = run(source, store, hit, a.requests, folder)
            print(point, flush=True)
            points.append(point)
    if a.out:
        a.out.write_text(json.dumps({"machine": machine(), "heavy": a.heavy,
                                     "requests_per_client": a.requests, "points": points},
                                    indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
