"""Cross-check servekit's load generator against wrk: same JSON body, same endpoint, same concurrency.

Starts `servekit serve`'s ResNet-50 (PyTriton) on loopback, writes one KServe v2 JSON
request (FP32 [1,3,224,224]) to a file, then measures it twice at the same concurrency:
servekit's closed loop (HTTP, JSON) and wrk (`-c N`, Lua script posting the file).
Needs wrk (Debian: apt-get install wrk).

    python bench/wrk_check.py --concurrency 4 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from servekit import BatchingPolicy, zoo
from servekit.bench import MeasureConfig, closed_loop, open_target
from servekit.triton import ServerConfig, TritonServer, default_models

LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open(os.getenv("SERVEKIT_BODY"), "rb")
wrk.body = f:read("*a")
f:close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    config = ServerConfig(
        host="127.0.0.1",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        exit_timeout_s=2,
    )
    models = default_models(
        zoo.build("resnet50"), name="resnet50", policy=BatchingPolicy(max_batch_size=8)
    )
    with TritonServer(models, config), tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.json"
        body.write_bytes(json_body(x))
        body_bytes = body.stat().st_size
        script = Path(tmp) / "post.lua"
        script.write_text(LUA)

        async def ours():
            target = open_target(config.http_url, "resnet50", {"input": x}, binary=False)
            try:
                cfg = MeasureConfig(window_s=args.seconds / 3, warmup_s=3, max_windows=6)
                return await closed_loop(target, args.concurrency, cfg)
            finally:
                await target.close()

        point = asyncio.run(ours())
        url = f"{config.http_url}/v2/models/resnet50/infer"
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
        out = subprocess.run(
            cmd,
            env={"SERVEKIT_BODY": str(body), "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    wrk_rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    ours_rps = point.stats.throughput
    print(out)
    result = {
        "concurrency": args.concurrency,
        "body_bytes": body_bytes,
        "servekit_requests_per_s": ours_rps,
        "servekit_p50_ms": point.stats.p50_ms,
        "servekit_errors": point.stats.errors,
        "wrk_requests_per_s": wrk_rps,
        "wrk_non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "difference": abs(ours_rps - wrk_rps) / wrk_rps,
        "wrk_command": " ".join(cmd[:-3]) + " -s post.lua URL",
    }
    print(json.dumps(result, indent=2))
    Path("bench/results/wrk_check.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
