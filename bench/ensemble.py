"""The Triton ensemble (servekit backend) against the in-process Pipeline and PyTriton, in one run.

All three classify the same 320x240 JPEG (decode, resize, crop, normalise, ResNet-50,
softmax, top-5). In-process: ``image_classifier`` called directly, batch 1, 8 and 16
(the best images/s is the ceiling; batch 1 latency at concurrency 1 is the baseline).
Served: the reference repository on the bundled tritonserver (``servekit triton``),
and ``servekit serve``'s ``resnet50_image`` on PyTriton, each swept over concurrency
with servekit's load generator over gRPC.

    python bench/ensemble.py --concurrency 1,2,4,8,16 --instances 2 --threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from servekit import BatchingPolicy, OnnxRuntimeRunner, image_classifier, zoo
from servekit.bench import MeasureConfig, open_target, parse_levels, sweep
from servekit.bench.compare import Setup, pipeline_ceiling
from servekit.bench.report import plot_latency_vs_throughput, write_csv, write_json
from servekit.config import ModelConfig, ServerConfig
from servekit.pytriton import TritonServer
from servekit.runtime import load_models
from servekit.stages import synthetic_image
from servekit.triton.launcher import TritonOptions, TritonProcess
from servekit.triton.repo import build_repository, reference_repository


def one_at_a_time_ms(clf, jpeg: bytes, seconds: float) -> tuple[float, float]:
    """p50 and p99 ms of classifying one image at a time."""
    lat = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        clf.classify([jpeg])
        lat.append((time.perf_counter() - t) * 1e3)
    lat.sort()
    return statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=8.0, help="per in-process measurement")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("bench/results/ensemble"))
    args = parser.parse_args()
    console = Console()
    jpeg = synthetic_image(0)
    payload = {"image": np.array([[jpeg]], dtype=object)}
    levels = parse_levels(args.concurrency)
    cfg = MeasureConfig(window_s=args.window, warmup_s=args.warmup, max_windows=8)
    policy = BatchingPolicy(max_batch_size=args.max_batch_size)

    path = zoo.build("resnet50")
    ceiling, by_batch = pipeline_ceiling(Setup.of(ModelConfig(str(path), "resnet50")), args.seconds)
    clf = image_classifier(OnnxRuntimeRunner(path))
    p50_1, p99_1 = one_at_a_time_ms(clf, jpeg, args.seconds)
    clf.close()
    console.print(
        f"in-process Pipeline images/s by batch {by_batch}; one at a time p50 {p50_1:.1f} ms, p99 {p99_1:.1f} ms"
    )

    async def measure(url: str, model: str):
        target = open_target(url, model, payload)
        try:
            return await sweep(target, levels, "concurrency", cfg)
        finally:
            await target.close()

    series = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_repository(
            repo,
            reference_repository(policy=policy, instances=args.instances, threads=args.threads),
        )
        opts = TritonOptions(repo, ServerConfig.on_loopback(exit_timeout_s=2, front=False))
        with TritonProcess(opts) as triton:
            triton.wait_ready(["preprocess", "resnet50", "postprocess", "resnet50_ensemble"])
            series["Triton ensemble (servekit backend)"] = asyncio.run(
                measure(opts.server.grpc_url, "resnet50_ensemble")
            )
    config = ServerConfig.on_loopback(exit_timeout_s=2, front=False)
    models = load_models(
        ModelConfig(
            str(path), "resnet50", batching=policy, instances=args.instances, threads=args.threads
        )
    )
    with TritonServer(models, config):
        series["PyTriton resnet50_image"] = asyncio.run(measure(config.grpc_url, "resnet50_image"))

    table = Table(
        "runtime",
        "concurrency",
        "images/s",
        "share of Pipeline",
        "p50 ms",
        "p99 ms",
        "errors",
        title=f"ResNet-50 on JPEGs; in-process Pipeline ceiling {ceiling:.1f} images/s",
    )
    table.add_row(
        "in-process Pipeline",
        "1 (batch 1)",
        f"{by_batch[1]:.1f}",
        f"{by_batch[1] / ceiling:.1%}",
        f"{p50_1:.1f}",
        f"{p99_1:.1f}",
        "0",
    )
    for name, points in series.items():
        for p in points:
            s = p.stats
            table.add_row(
                name,
                str(p.level),
                f"{s.inferences_per_s:.1f}",
                f"{s.inferences_per_s / ceiling:.1%}",
                f"{s.p50_ms:.1f}",
                f"{s.p99_ms:.1f}",
                str(s.errors),
            )
    console.print(table)
    ens = series["Triton ensemble (servekit backend)"]
    best = max(p.stats.inferences_per_s for p in ens)
    console.print(
        f"ensemble at saturation: {best:.1f} images/s = {best / ceiling:.1%} of the Pipeline's {ceiling:.1f}; "
        f"p99 at concurrency 1: {ens[0].stats.p99_ms:.1f} ms = {ens[0].stats.p99_ms / p99_1:.2f}x the Pipeline's {p99_1:.1f} ms"
    )
    meta = {
        "pipeline_images_per_s_by_batch": by_batch,
        "pipeline_ceiling": ceiling,
        "pipeline_one_at_a_time_ms": {"p50": p50_1, "p99": p99_1},
        "served": {
            "instances": args.instances,
            "threads": args.threads,
            "max_batch_size": args.max_batch_size,
        },
    }
    write_json(series, args.out.with_suffix(".json"), meta)
    write_csv(series, args.out.with_suffix(".csv"))
    plot_latency_vs_throughput(
        series, args.out.with_suffix(".png"), title="ResNet-50 on JPEGs: ensemble vs PyTriton"
    )


if __name__ == "__main__":
    main()
