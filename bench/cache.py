"""The response cache's cost and gain: server CPU per request with no cache, and with the
cache at 0 %, 50 % and 99 % hits: on native (local, or a real redis-server), and on the
triton runtime, servekit's cache in its front against tritonserver's own
(``response_cache { enable: true }``, ``--cache-config local``) on the same model.

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


def run(source: Path, runtime: str, store: str, hit: float, requests: int, folder: Path) -> dict:
    """One point. ``store``: none, local, redis (servekit's cache), or tritons
    (tritonserver's own, behind servekit's front, which then keeps nothing)."""
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
    config = folder / f"{runtime}-{store}-{hit}.toml"
    ours = store in ("local", "redis")
    config.write_text(CONFIG.format(runtime=runtime, http=http, grpc=grpc, metrics=metrics,
                                    cache=cache, source=source,
                                    cached=str(ours).lower()))  # fmt: skip
    command: tuple[str, ...] = ("serve",)
    if store == "tritons":  # servekit's repository, with tritonserver's cache turned on
        repo = folder / f"repo-{hit}"
        subprocess.run([sys.executable, "-m", "servekit", "repo", "build", str(repo),
                        "--config", str(config)], check=True, capture_output=True)  # fmt: skip
        pbtxt = repo / "add_sub" / "config.pbtxt"
        pbtxt.write_text(pbtxt.read_text() + "\nresponse_cache { enable: true }\n")
        import pytriton

        caches = Path(pytriton.__file__).parent / "tritonserver" / "caches"
        command = ("triton", "--model-repository", str(repo), "--",
                   f"--cache-config=local,size={256 * 2**20}",
                   f"--cache-directory={caches}")  # fmt: skip
    url = f"127.0.0.1:{http}"
    try:
        with serve_process(config, f"http://{url}", "add_sub", command=command) as server:
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
            text = "".join(  # the front's (servekit's cache) and the metrics port's
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
                for port in (http, metrics)
            )
        hits = metric(text, "nv_cache_num_hits_per_model")
        misses = metric(text, "nv_cache_num_misses_per_model")
        return {
            "runtime": runtime,
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
    p.add_argument("--runtimes", default="native,triton")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "add_sub_heavy.onnx"
        onnx.save(build_add_sub(heavy=a.heavy), source)
        hits = (0.0, 0.5, 0.99)
        cases = {
            "native": [("none", 0.0)] + [(s, h) for s in ("local", "redis") for h in hits],
            "triton": [("none", 0.0)] + [(s, h) for s in ("local", "tritons") for h in hits],
        }
        for runtime, store, hit in [(r, *c) for r in a.runtimes.split(",") for c in cases[r]]:
            point = run(source, runtime, store, hit, a.requests, folder)
            print(point, flush=True)
            points.append(point)
    if a.out:
        a.out.write_text(json.dumps({"machine": machine(), "heavy": a.heavy,
                                     "requests_per_client": a.requests, "points": points},
                                    indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
