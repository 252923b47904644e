"""Threads or processes for model instances? The cost of moving one batch to a worker and back.

A process pool must pickle every input and output across the process boundary; a
thread shares memory. This measures the round trip of a no-op on ResNet-50-sized
batches (float32 [N,3,224,224]) through each, and the served ResNet-50 throughput with
one and two instance threads, to justify the Batcher's choice of threads.

    python bench/executors.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from servekit import Batcher, BatchingPolicy, OnnxRuntimeRunner, zoo


def echo(x: np.ndarray) -> np.ndarray:
    return x


def round_trip_ms(pool: Executor, x: np.ndarray, repeats: int = 20) -> float:
    pool.submit(echo, x).result()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        pool.submit(echo, x).result()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def served(instances: int, threads_per_instance: int, seconds: float = 15.0) -> float:
    runner = OnnxRuntimeRunner(zoo.build("resnet50"), intra_op_threads=threads_per_instance)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    policy = BatchingPolicy(max_batch_size=8)
    async with Batcher(runner, policy, instance_count=instances) as batcher:
        done = 0
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await batcher.infer({"input": x})
                done += 1

        await asyncio.gather(*(batcher.infer({"input": x}) for _ in range(8)))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(16)))
        return done / (time.perf_counter() - start)


def main() -> None:
    rows = []
    with ThreadPoolExecutor(1) as threads, ProcessPoolExecutor(1) as processes:
        for n in (1, 8, 32):
            x = np.zeros((n, 3, 224, 224), np.float32)
            rows.append(
                {
                    "batch": n,
                    "thread_ms": round_trip_ms(threads, x),
                    "process_ms": round_trip_ms(processes, x),
                }
            )
    served_rows = {
        "1 instance x 2 ORT threads": asyncio.run(served(1, 2)),
        "2 instances x 1 ORT thread": asyncio.run(served(2, 1)),
    }
    console = Console()
    table = Table(
        "batch", "MB", "thread round trip ms", "process round trip ms", title="moving one batch"
    )
    for r in rows:
        mb = r["batch"] * 3 * 224 * 224 * 4 / 1e6
        table.add_row(
            str(r["batch"]), f"{mb:.1f}", f"{r['thread_ms']:.3f}", f"{r['process_ms']:.1f}"
        )
    console.print(table)
    for name, ips in served_rows.items():
        console.print(f"ResNet-50 through the Batcher, {name}: {ips:.1f} images/s")
    out = Path("bench/results/executors.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"round_trip": rows, "served_images_per_s": served_rows}, indent=2))


if __name__ == "__main__":
    main()
