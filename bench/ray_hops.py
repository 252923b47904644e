"""Where a Ray app's CPU goes per request, hop by hop: Ray's HTTP proxy, the ingress
replica, the model replica, Ray's own daemons, with and without ``[ray] direct``.

Each app serves ``sim_t4`` as ``servekit compare`` serves it (max_batch_size 32, one
model replica, HTTP binary tensors), closed loop at one concurrency; the CPU of each
process of the server's tree is read before and after the load and divided by the
requests answered, grouped by what the process calls itself (``ray::ProxyActor``,
``ray::ServeReplica:servekit:Ingress``, ``raylet``, ...).

    python bench/ray_hops.py --out bench/results/ray_hops
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from servekit.batching import BatchingPolicy
from servekit.bench.compare import RUNTIMES, Setup
from servekit.bench.cpu import tree_cpu_by_title
from servekit.bench.loadgen import MeasureConfig, closed_loop
from servekit.cli.common import model_source
from servekit.config import ModelConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtimes", default="ray,ray-direct")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("bench/results/ray_hops"))
    args = ap.parse_args()
    model = ModelConfig(
        model_source("sim_t4", None), "sim_t4", batching=BatchingPolicy(max_batch_size=32),
        threads=1,
    )  # fmt: skip
    setup = Setup.of(model)
    measure = MeasureConfig(window_s=3.0, warmup_s=2.0, max_windows=4, stable_windows=2)
    rows = []
    for runtime in args.runtimes.split(","):
        print(f"measuring {runtime}")
        with RUNTIMES[runtime](setup) as (factory, pid):

            async def load(factory=factory):  # type: ignore[no-untyped-def]
                target = factory()  # its client needs the running loop
                try:
                    return await closed_loop(target, args.concurrency, measure)
                finally:
                    await target.close()

            before, start = tree_cpu_by_title(pid), time.monotonic()
            point = asyncio.run(load())
            after, wall = tree_cpu_by_title(pid), time.monotonic() - start
        per_s = point.stats.throughput
        hops = {
            name: round((after[name] - before.get(name, 0.0)) / wall / per_s * 1e6)
            for name in after
            if after[name] - before.get(name, 0.0) > 0
        }
        rows.append({"runtime": runtime, "requests_per_s": round(per_s, 1), "hops_us": hops})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")
    names = sorted({n for r in rows for n in r["hops_us"]})
    print("| process | " + " | ".join(r["runtime"] for r in rows) + " |")
    print("| --- |" + " ---: |" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(str(r["hops_us"].get(name, 0)) for r in rows) + " |")
    print("| requests/s | " + " | ".join(str(r["requests_per_s"]) for r in rows) + " |")


if __name__ == "__main__":
    main()
