"""The floor of a Python hop: tritonserver's own HTTP port, then the same port behind
each hop variant (bench/python_hop_proxy.py) in a process of its own; a hop's own CPU
per request is the proxy process's CPU divided by the requests answered.

    python bench/python_hop.py uvicorn,uvicorn+uvloop,raw,raw+uvloop,raw+uvloop+check,front
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench import MeasureConfig
from servekit.bench.compare import ServerProcess, Setup
from servekit.endpoints import free_port

sys.path.insert(0, str(Path(__file__).parent))
from serving_cost import measure  # noqa: E402

PROXY = Path(__file__).with_name("python_hop_proxy.py")


def show(name: str, protocol: str, point) -> None:
    print(
        f"{name:28s} {protocol:12s} {point.stats.throughput:7.0f}/s "
        f"server {point.server_cpu_us:6.0f} us client {point.client_cpu_us:5.0f} us "
        f"errors {point.stats.errors}",
        flush=True,
    )


def main() -> None:
    variants = sys.argv[1].split(",")
    protocols = sys.argv[2].split(",") if len(sys.argv) > 2 else ["http-json", "http-binary"]
    model = ModelConfig(str(zoo.resolve("add_sub")), batching=BatchingPolicy(max_batch_size=8))
    setup = Setup.of(model)
    cfg = MeasureConfig(window_s=3.0, warmup_s=2.0, max_windows=5, stability=0.15)
    config = ServeConfig(
        (model,), ServerConfig(front=False, exit_timeout_s=2), runtime="triton"
    ).on_loopback()
    with ServerProcess(config) as server:
        server.wait_ready([setup.target])
        upstream = config.server.http_url.rsplit(":", 1)[1]
        for protocol in protocols:
            pace = dataclasses.replace(cfg, server_pid=server.pid)
            show("tritonserver's own", protocol,
                 measure(config.server.http_url, setup.target, setup.payload, protocol, pace, 8))  # fmt: skip
        for variant in variants:
            port = free_port()
            kind, *flags = variant.split("+")
            proxy = subprocess.Popen(
                [sys.executable, str(PROXY), kind, str(port), upstream, *flags]
            )
            time.sleep(3)
            try:
                for protocol in protocols:
                    pace = dataclasses.replace(cfg, server_pid=proxy.pid)
                    url = f"http://127.0.0.1:{port}"
                    show(f"{variant} (hop only)", protocol,
                         measure(url, setup.target, setup.payload, protocol, pace, 8))  # fmt: skip
            finally:
                proxy.terminate()
                proxy.wait()


if __name__ == "__main__":
    main()
