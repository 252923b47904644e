"""Raw in-process ResNet-50 throughput per batch size: the ceiling every server is measured against.

Runs the ONNX Runtime runner directly on preprocessed tensors ("model") and, with
``--pipeline``, the whole image pipeline on encoded JPEGs ("pipeline": decode,
resize, crop, normalise, ResNet-50, softmax, top-5). Writes JSON and CSV.

    python bench/raw.py --batch-sizes 1,4,8,16,32 --seconds 10 --pipeline
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from servekit import OnnxRuntimeRunner, image_classifier, zoo
from servekit.stages import Preprocess, synthetic_image


def measure(fn, rows: int, seconds: float, min_iters: int = 5) -> dict[str, float]:
    """Call ``fn`` repeatedly for ``seconds`` (after 3 warm-up calls); rows/s and latency stats."""
    for _ in range(3):
        fn()
    latencies: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(latencies) < min_iters:
        t0 = time.perf_counter()
        fn()
        latencies.append(time.perf_counter() - t0)
    total = sum(latencies)
    latencies.sort()
    return {
        "iterations": len(latencies),
        "throughput": rows * len(latencies) / total,
        "p50_ms": 1e3 * statistics.median(latencies),
        "p95_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,8,16,32")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed window per point")
    parser.add_argument("--threads", type=int, default=None, help="ORT intra-op threads")
    parser.add_argument("--pipeline", action="store_true", help="also time the JPEG pipeline")
    parser.add_argument("--out", type=Path, default=Path("bench/results/raw"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.batch_sizes.split(",")]

    path = zoo.build("resnet50")
    runner = OnnxRuntimeRunner(path, intra_op_threads=args.threads)
    jpegs = [synthetic_image(i) for i in range(max(sizes))]
    tensors = Preprocess(workers=1).images(jpegs)
    clf = image_classifier(path, intra_op_threads=args.threads) if args.pipeline else None

    rows = []
    for n in sizes:
        x = {"input": np.ascontiguousarray(tensors[:n])}
        rows.append(
            {
                "target": "model",
                "batch_size": n,
                **measure(lambda x=x: runner.infer(x), n, args.seconds),
            }
        )
        if clf is not None:
            imgs = jpegs[:n]
            rows.append(
                {
                    "target": "pipeline",
                    "batch_size": n,
                    **measure(lambda i=imgs: clf.classify(i), n, args.seconds),
                }
            )

    table = Table(
        "target", "batch", "images/s", "p50 ms", "p95 ms", "iters", title="raw in-process ResNet-50"
    )
    for r in rows:
        table.add_row(
            r["target"],
            str(r["batch_size"]),
            f"{r['throughput']:.1f}",
            f"{r['p50_ms']:.1f}",
            f"{r['p95_ms']:.1f}",
            str(r["iterations"]),
        )
    Console().print(table)
    meta = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.processor() or platform.platform()}",
        "onnxruntime_threads": args.threads,
        "seconds_per_point": args.seconds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
