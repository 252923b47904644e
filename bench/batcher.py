"""Batcher overhead: requests/s through servekit's Batcher and Ray Serve's @serve.batch.

Every variant runs the same no-op model (returns its input) with max_batch_size 64 and
no queue delay, driven in-process by concurrent callers:

- ``servekit asyncio``: N asyncio tasks awaiting ``Batcher.infer``, with batches run on a
  worker thread (``executor="threads"``, the default, for engines) or on the event loop
  (``executor="loop"``, as ``@serve.batch`` runs them); default asyncio loop, and uvloop
  when installed (Ray Serve's loop).
- ``servekit infer_sync``: T threads calling ``Batcher.infer_sync``.
- ``ray @serve.batch``: N asyncio tasks awaiting a ``@serve.batch`` method inside a
  local Ray Serve replica, and, in the same replica, servekit's Batcher again, so
  both run in one process under one event loop (Ray's, uvloop).
- ``latency``: one request at a time; the Batcher's median minus the bare call's.

    python bench/batcher.py            # needs the `ray` extra for the Ray rows
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from servekit import Batcher, BatchingPolicy, ModelSpec, TensorSpec

SPEC = ModelSpec((TensorSpec("x", np.float32, [4]),), (TensorSpec("y", np.float32, [4]),), 64)
POLICY = BatchingPolicy(max_batch_size=64)
X = np.ones((1, 4), np.float32)


def noop(inputs):
    return {"y": inputs["x"]}


async def drive(call, total: int, concurrency: int) -> float:
    """``total`` awaits of ``call()`` from ``concurrency`` tasks; requests/s."""
    remaining = total

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return total / (time.perf_counter() - start)


async def servekit_async(total: int, concurrency: int, executor: str = "threads") -> float:
    async with Batcher(noop, POLICY, spec=SPEC, executor=executor) as batcher:
        inputs = {"x": X}
        await drive(lambda: batcher.infer(inputs), total // 10, concurrency)  # warm-up
        return await drive(lambda: batcher.infer(inputs), total, concurrency)


def servekit_threads(total: int, threads: int) -> float:
    with Batcher(noop, POLICY, spec=SPEC) as batcher:
        inputs = {"x": X}
        per = total // threads

        def caller() -> None:
            for _ in range(per):
                batcher.infer_sync(inputs)

        batcher.infer_sync(inputs)
        workers = [threading.Thread(target=caller) for _ in range(threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return per * threads / (time.perf_counter() - start)


async def added_latency_us(samples: int, executor: str = "threads") -> tuple[float, float]:
    """Median latency of one request at a time through the Batcher, and of the bare call."""
    async with Batcher(noop, POLICY, spec=SPEC, executor=executor) as batcher:
        inputs = {"x": X}
        for _ in range(samples // 10):
            await batcher.infer(inputs)
        through, bare = [], []
        for _ in range(samples):
            t = time.perf_counter()
            await batcher.infer(inputs)
            through.append(time.perf_counter() - t)
            t = time.perf_counter()
            noop(inputs)
            bare.append(time.perf_counter() - t)
    return statistics.median(through) * 1e6, statistics.median(bare) * 1e6


def ray_rows(total: int, concurrency: int) -> dict[str, float]:
    """Run @serve.batch and servekit's Batcher inside one local Ray Serve replica."""
    import ray
    from ray import serve

    @serve.deployment(max_ongoing_requests=1, ray_actor_options={"num_cpus": 1})
    class BatchBench:
        def __init__(self) -> None:
            self.batchers = {
                e: Batcher(noop, POLICY, spec=SPEC, executor=e) for e in ("threads", "loop")
            }

        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.0)
        async def batched(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            out = noop({"x": np.concatenate(xs)})["y"]
            return [out[i : i + 1] for i in range(len(xs))]

        async def __call__(self, which: str, n: int, conc: int) -> float:
            if which == "serve.batch":
                call = lambda: self.batched(X)  # noqa: E731
            else:
                inputs, batcher = {"x": X}, self.batchers[which]
                call = lambda: batcher.infer(inputs)  # noqa: E731
            await drive(call, n // 10, conc)
            return await drive(call, n, conc)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(BatchBench.bind(), name="batchbench", route_prefix=None)
        runs = {
            "in a Ray Serve replica: @serve.batch": "serve.batch",
            "in the same replica: servekit, executor=loop": "loop",
            "in the same replica: servekit, executor=threads": "threads",
        }
        return {
            label: handle.remote(which, total, concurrency).result()
            for label, which in runs.items()
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300_000)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--trials", type=int, default=3, help="report the median of this many runs")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/batcher.json"))
    args = parser.parse_args()

    def median_of(fn) -> float:
        return statistics.median(fn() for _ in range(args.trials))

    rows: dict[str, float] = {}
    loops = {"asyncio": asyncio.run}
    try:
        import uvloop

        loops["uvloop"] = uvloop.run
    except ImportError:
        pass
    for executor in ("threads", "loop"):
        for loop_name, run in loops.items():
            rows[f"servekit asyncio, executor={executor}, {loop_name}"] = median_of(
                lambda run=run, executor=executor: run(
                    servekit_async(args.requests, args.concurrency, executor)
                )
            )
    rows["servekit infer_sync, 64 threads"] = median_of(
        lambda: servekit_threads(args.requests // 10, args.threads)
    )
    if not args.no_ray:
        trials = [ray_rows(args.requests, args.concurrency) for _ in range(args.trials)]
        for key in trials[0]:
            rows[key] = statistics.median(t[key] for t in trials)
    latency = {}
    for executor in ("threads", "loop"):
        lat = [asyncio.run(added_latency_us(20_000, executor)) for _ in range(args.trials)]
        through = statistics.median(t for t, _ in lat)
        bare = statistics.median(b for _, b in lat)
        latency[executor] = {"batcher_p50": through, "bare_p50": bare, "added_p50": through - bare}

    table = Table("variant", "requests/s", title="no-op model, max_batch_size 64, no queue delay")
    for name, value in rows.items():
        table.add_row(name, f"{value:,.0f}")
    console = Console()
    console.print(table)
    ray_key = "in a Ray Serve replica: @serve.batch"
    if ray_key in rows:
        for key in rows:
            if key.startswith("in the same replica"):
                console.print(
                    f"{key.split(': ')[1]} / @serve.batch: {rows[key] / rows[ray_key]:.1f}x"
                )
    for executor, lat in latency.items():
        console.print(
            f"one request at a time, executor={executor}: {lat['batcher_p50']:.1f} us through the "
            f"Batcher, {lat['bare_p50']:.2f} us bare call, added {lat['added_p50']:.1f} us "
            f"(median of {args.trials} x 20,000)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()} {os.cpu_count()} cpus, Python {platform.python_version()}",
                "args": {k: str(v) for k, v in vars(args).items()},
                "requests_per_s": rows,
                "latency_us": {
                    "batcher_p50": through,
                    "bare_p50": bare,
                    "added_p50": through - bare,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
