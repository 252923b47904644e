"""ResNet-50 through PyTriton (`servekit serve`) against the raw in-process ceiling, in one run.

Raw: ``OnnxRuntimeRunner.infer`` called directly at batch 1, 8 and 16 (ONNX Runtime's
default threads); the best images/s is the ceiling. Served: the same model behind Triton
(PyTriton, gRPC, Triton's dynamic batcher), one image per request, closed loop over the
concurrency levels with servekit's load generator (perf_analyzer's stable windows).

    python bench/serve_pytriton.py --concurrency 1,2,4,8,16 --instances 2 --threads 1 --max-batch-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from servekit import BatchingPolicy, OnnxRuntimeRunner, zoo
from servekit.bench import MeasureConfig, open_target, parse_levels, rows_per_s, sweep
from servekit.bench.report import plot_latency_vs_throughput, write_csv, write_json
from servekit.config import ModelConfig, ServerConfig
from servekit.pytriton import TritonServer
from servekit.runtime import load_models


def raw_images_per_s(runner: OnnxRuntimeRunner, batch: int, seconds: float) -> float:
    x = {"input": np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)}
    return rows_per_s(lambda: runner.infer(x), batch, seconds, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--raw-seconds", type=float, default=10.0)
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--instances", type=int, default=1, help="served model instances")
    parser.add_argument("--threads", type=int, default=None, help="ORT threads per served instance")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--shared-memory", action="store_true", help="client inputs via system shm")
    parser.add_argument("--out", type=Path, default=Path("bench/results/pytriton"))
    args = parser.parse_args()
    console = Console()

    path = zoo.build("resnet50")
    with OnnxRuntimeRunner(path) as runner:
        raw = {b: raw_images_per_s(runner, b, args.raw_seconds) for b in (1, 8, 16)}
    ceiling = max(raw.values())
    console.print(f"raw in-process images/s by batch: { {b: round(v, 1) for b, v in raw.items()} }")

    policy = BatchingPolicy(max_batch_size=args.max_batch_size)
    config = ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    cfg = MeasureConfig(window_s=args.window, warmup_s=args.warmup, max_windows=8)
    models = load_models(
        ModelConfig(
            str(path), "resnet50", batching=policy, instances=args.instances, threads=args.threads
        )
    )
    with TritonServer(models, config) as server:
        url = config.grpc_url if args.protocol == "grpc" else config.http_url
        x = {"input": np.random.default_rng(1).standard_normal((1, 3, 224, 224)).astype(np.float32)}

        async def run():
            target = open_target(
                url,
                "resnet50",
                x,
                shared_memory="system" if args.shared_memory else None,
                access_token=server.access_token,
            )
            try:
                return await sweep(target, parse_levels(args.concurrency), "concurrency", cfg)
            finally:
                await target.close()

        points = asyncio.run(run())

    table = Table(
        "concurrency",
        "images/s",
        "share of raw",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "errors",
        "stable",
        title=f"ResNet-50 via PyTriton ({args.protocol}{', shm' if args.shared_memory else ''}), raw ceiling {ceiling:.1f} images/s",
    )
    for p in points:
        s = p.stats
        table.add_row(
            str(p.level),
            f"{s.inferences_per_s:.1f}",
            f"{s.inferences_per_s / ceiling:.1%}",
            f"{s.p50_ms:.1f}",
            f"{s.p95_ms:.1f}",
            f"{s.p99_ms:.1f}",
            str(s.errors),
            str(p.stable),
        )
    console.print(table)
    best = max(p.stats.inferences_per_s for p in points)
    console.print(f"saturation: {best:.1f} images/s = {best / ceiling:.1%} of raw {ceiling:.1f}")
    series = {f"PyTriton ({args.protocol}{', shm' if args.shared_memory else ''})": points}
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
        "raw_images_per_s_by_batch": raw,
        "raw_ceiling": ceiling,
        "served": {
            "instances": args.instances,
            "threads": args.threads,
            "max_batch_size": args.max_batch_size,
        },
        "saturation_share_of_raw": best / ceiling,
    }
    write_json(series, args.out.with_suffix(".json"), meta)
    write_csv(series, args.out.with_suffix(".csv"))
    plot_latency_vs_throughput(series, args.out.with_suffix(".png"), title="ResNet-50 via PyTriton")


if __name__ == "__main__":
    main()
