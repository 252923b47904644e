"""Cross-check servekit's load generator against wrk: same JSON body, same endpoint, same concurrency.

Starts `servekit serve` (ResNet-50 on PyTriton) as its own process on loopback, writes one KServe v2 JSON
request (FP32 [1,3,224,224]) to a file, then measures it twice at the same concurrency:
servekit's closed loop (HTTP, JSON) between two wrk runs (`-c N`, Lua script posting
the file), compared with the mean of the two.
Needs wrk (Debian: apt-get install wrk).

    python bench/wrk_check.py --concurrency 4 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from servekit.bench import MeasureConfig, closed_loop, open_target
from servekit.client import Client
from servekit.endpoints import free_port

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("SERVEKIT_BODY"), "rb")
wrk.body = f:read("*a")
f:close()
"""


def json_body(x: np.ndarray) -> bytes:
    import tritonclient.http as th

    i = th.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=False)
    body, json_size = th.InferenceServerClient.generate_request_body([i])
    assert json_size is None  # pure JSON, no binary tail
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=30)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (Debian: apt-get install wrk)")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ports = {"http": free_port(), "grpc": free_port(), "metrics": free_port()}
    http_url = f"http://127.0.0.1:{ports['http']}"
    # The server runs in its own process (the real `servekit serve`), as it would for wrk:
    # in this process it would share the GIL with the load generator.
    server = subprocess.Popen(
        [sys.executable, "-m", "servekit.cli", "serve", "--model", "resnet50", "--host", "127.0.0.1",
         "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
         "--max-batch-size", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with Client(http_url) as c:
            c.wait_ready("resnet50", timeout_s=180)
        with tempfile.TemporaryDirectory() as tmp:
            body = Path(tmp) / "body.json"
            body.write_bytes(json_body(x))
            body_bytes = body.stat().st_size
            script = Path(tmp) / "post.lua"
            script.write_text(LUA)

            async def ours():
                target = open_target(http_url, "resnet50", {"input": x}, binary=False)
                try:
                    cfg = MeasureConfig(window_s=args.seconds / 3, warmup_s=3, max_windows=6)
                    return await closed_loop(target, args.concurrency, cfg)
                finally:
                    await target.close()

            url = f"{http_url}/v2/models/resnet50/infer"
            cmd = [
                "wrk",
                "-t",
                "2",
                "-c",
                str(args.concurrency),
                "-d",
                f"{args.seconds}s",
                "--latency",
                "-s",
                str(script),
                url,
            ]
            env = {"SERVEKIT_BODY": str(body), "PATH": "/usr/bin:/bin"}

            def wrk() -> tuple[float, int]:
                out = subprocess.run(
                    cmd, env=env, capture_output=True, text=True, check=True
                ).stdout
                print(out)
                non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
                rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))
                return rps, int(non2xx.group(1)) if non2xx else 0

            # wrk before and after ours, so drift on a shared machine shows and averages out.
            before, bad_before = wrk()
            point = asyncio.run(ours())
            after, bad_after = wrk()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    wrk_rps = (before + after) / 2
    ours_rps = point.stats.throughput
    result = {
        "concurrency": args.concurrency,
        "body_bytes": body_bytes,
        "servekit_requests_per_s": ours_rps,
        "servekit_p50_ms": point.stats.p50_ms,
        "servekit_errors": point.stats.errors,
        "servekit_client_cpu_cores": point.client_cpu,
        "wrk_requests_per_s_before": before,
        "wrk_requests_per_s_after": after,
        "wrk_requests_per_s": wrk_rps,
        "wrk_non_2xx": bad_before + bad_after,
        "difference": abs(ours_rps - wrk_rps) / wrk_rps,
        "wrk_command": " ".join(cmd[:-3]) + " -s post.lua URL",
    }
    print(json.dumps(result, indent=2))
    Path("bench/results/wrk_check.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
