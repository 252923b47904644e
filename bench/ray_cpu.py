"""Where the CPU goes when the Ray Serve app classifies JPEGs: CPU per process under load.

    python bench/ray_cpu.py [--concurrency 16] [--seconds 15] [--out bench/results/ray_cpu.json]

Starts a local Ray with the app laid out as in ``servekit compare`` (2 model replicas x 1
ORT thread, max_batch_size 8), drives it closed loop over HTTP with the load generator,
and reports images/s and each process's CPU (cores) over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import psutil
import ray
from ray import serve

from servekit import BatchingPolicy, zoo
from servekit.bench.loadgen import MeasureConfig, sweep
from servekit.bench.targets import open_target
from servekit.config import ModelConfig, RayOptions, ServeConfig
from servekit.endpoints import free_port
from servekit.ray import build_app
from servekit.stages import synthetic_image


def cpu_seconds() -> dict[int, tuple[str, float]]:
    out = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            t = p.cpu_times()
            name = " ".join(p.info["cmdline"] or [p.info["name"]])
            out[p.pid] = (name[:50], t.user + t.system)
        except psutil.Error:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/ray_cpu.json"))
    args = ap.parse_args()

    path = zoo.build("resnet50")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        model = ModelConfig(
            str(path), "resnet50", batching=BatchingPolicy(max_batch_size=8), instances=2, threads=1
        )
        app = build_app(ServeConfig((model,), runtime="ray", ray=RayOptions(model_cpus=0.5)))
        serve.run(app, name="servekit", route_prefix="/")
        payload = {"image": np.array([[synthetic_image(0)]], dtype=object)}
        cfg = MeasureConfig(window_s=args.seconds / 3, warmup_s=3, max_windows=3)

        async def drive():
            target = open_target(f"http://127.0.0.1:{port}", "resnet50_image", payload)
            try:
                return await sweep(target, [args.concurrency], "concurrency", cfg)
            finally:
                await target.close()

        before, start = cpu_seconds(), time.perf_counter()
        (point,) = asyncio.run(drive())
        after, elapsed = cpu_seconds(), time.perf_counter() - start
    finally:
        serve.shutdown()
        ray.shutdown()
    usage = sorted(
        ((after[p][1] - before.get(p, ("", 0.0))[1]) / elapsed, after[p][0]) for p in after
    )
    busy = [(round(c, 3), name) for c, name in reversed(usage) if c >= 0.005]
    result = {
        "concurrency": args.concurrency,
        "images_per_s": round(point.stats.throughput, 2),
        "cpu_cores_by_process": busy,
        "cpu_cores_total": round(sum(c for c, _ in busy), 2),
    }
    print(f"{result['images_per_s']} images/s at concurrency {args.concurrency}")
    for cores, name in busy:
        print(f"{cores:6.2f} cores  {name}")
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
