"""Overload that never collapses (issue 71): goodput at twice a server's capacity.

``sim_t4`` (a simulated T4 ResNet-50, max batch 32; ``--scale`` times slower than a T4,
32 by default, so that on a 2-core machine the load generator keeps up with twice its
capacity and retries: it says ``client_bound`` where it did not) on one instance. For
each runtime:
its capacity, measured first (closed loop, 64 clients, no deadline); then open-loop
(Poisson) load at twice that for ``--seconds``, clients with a deadline of four full-batch
times (a full batch's time is 32 / capacity) that retry once. Goodput (answers within
their client's deadline, per second) is reported as a share of the capacity measured in
the same run. Each servekit runtime runs with ``shed_late``; ``triton-own`` is
tritonserver's own HTTP port (``front = false``: no front, no window, no shedding).

    .venv/bin/python bench/overload.py --seconds 60 --out bench/results/overload.json

Servers run as processes of their own (``servekit serve --config``); the load generator
is this process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig
from servekit.bench import MeasureConfig, closed_loop, open_loop, open_target
from servekit.bench.process import ServerProcess
from servekit.zoo.tiny import build_sim_t4

RUNTIMES = ("native", "pytriton", "triton", "triton-own")


def config(path: Path, runtime: str) -> ServeConfig:
    own = runtime == "triton-own"
    policy = BatchingPolicy(max_batch_size=32, shed_late=not own)
    model = ModelConfig(str(path), "m", batching=policy, instances=1)
    server = ServerConfig(front=not own, exit_timeout_s=5)
    return ServeConfig((model,), server, runtime="triton" if own else runtime).on_loopback()


async def measure(url: str, seconds: float) -> dict[str, float]:
    x = {"input": np.zeros((1, 64, 64, 3), np.float32)}
    target = open_target(url, "m", x)
    try:
        saturate = MeasureConfig(window_s=3.0, warmup_s=2.0, max_windows=3)
        capacity = (await closed_loop(target, 64, saturate)).stats.throughput
        batch_s = 32 / capacity
        cfg = MeasureConfig(
            window_s=seconds, warmup_s=2.0, max_windows=3, stable_windows=1,
            timeout_ms=4 * batch_s * 1e3, retries=1, max_in_flight=100_000,
        )  # fmt: skip
        point = await open_loop(target, 2 * capacity, cfg)
    finally:
        await target.close()
    s = point.stats
    return {
        "capacity_per_s": capacity,
        "deadline_ms": 4 * batch_s * 1e3,
        "offered_per_s": 2 * capacity,
        "achieved_rate": point.achieved_rate,
        "throughput_per_s": s.throughput,
        "goodput_per_s": s.goodput,
        "goodput_of_capacity": s.goodput / capacity,
        "sent_per_s": s.sent_per_s,
        "timed_out": s.timed_out,
        "refused": s.refused,
        "retried": s.retried,
        "errors": s.errors,
        "p50_ms": s.p50_ms,
        "p99_ms": s.p99_ms,
        "client_bound": point.client_bound,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--scale", type=float, default=32.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="servekit-overload-"))
    path = folder / "sim_t4.onnx"
    onnx.save(build_sim_t4(scale=args.scale), path)
    results: dict[str, dict[str, float]] = {}
    for runtime in args.runtimes.split(","):
        c = config(path, runtime)
        with ServerProcess(c) as server:
            server.wait_ready(["m"])
            results[runtime] = asyncio.run(measure(c.server.http_url, args.seconds))
        r = results[runtime]
        print(
            f"{runtime:>10}: capacity {r['capacity_per_s']:7.1f}/s, offered "
            f"{r['offered_per_s']:7.1f}/s, deadline {r['deadline_ms']:.0f} ms: goodput "
            f"{r['goodput_per_s']:7.1f}/s = {r['goodput_of_capacity']:.0%} of capacity "
            f"(timed out {r['timed_out']}, refused {r['refused']}, retried {r['retried']}"
            f"{', client-bound' if r['client_bound'] else ''})",
            flush=True,
        )
    if args.out is not None:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
            "seconds": args.seconds,
            "scale": args.scale,
            "policy": dataclasses.asdict(BatchingPolicy(max_batch_size=32, shed_late=True)),
        }
        args.out.write_text(json.dumps({"meta": meta, "runtimes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
