"""The GPU host path without a GPU: 600 KB requests into a simulated H200 through the Batcher.

A real GPU waits on the host: every request's rows must be gathered into one batch and
handed over before the device runs it. This stand-in keeps that host work real (ResNet-50
requests of 3x224x224 float32, 600 KB each, from ``--clients`` asyncio tasks, each with
its own arrays) and replaces the device by ``SimulatedDevice`` at the H200's measured FP16
rate for ResNet-50 (600 us + 65.5 us a row: 14,245 images/s at batch 128), which
sleeps without CPU and, like a CUDA stream, starts a batch handed over while it is busy
the moment the last one ends (``--lock``: only once a host thread takes the free device).
The served rate over that ceiling is the device's busy share: what the host path lets it
do. Server CPU per request is the whole process's (clients included).

``--gather concat`` puts back the path before staging (a new concatenation per batch)
for a before/after in one run.

    python bench/host_path.py                # both gathers, 1 and 2 instances
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from servekit import Batcher, BatchingPolicy, FunctionRunner, ModelSpec, TensorSpec
from servekit.batching.concat import concat
from servekit.runners.simulated import DeviceProfile, SimulatedDevice
from servekit.runners.staging import Staging

H200_FP16 = DeviceProfile("h200-resnet50-fp16", 600.0, 65.5, queued=True)
"""ResNet-50 FP16 on an H200 through TorchRunner's CUDA graphs, as a line through the
engine's measured batch times (bench/results/gpu-h200-2026-11-26.json); queued, as a
CUDA stream runs work handed over while it is busy."""

IMAGE = (3, 224, 224)
MAX_BATCH = 128


def device(name: str, queued: bool) -> SimulatedDevice:
    spec = ModelSpec(
        (TensorSpec("input", np.float32, list(IMAGE)),),
        (TensorSpec("logits", np.float32, [1000]),),
        MAX_BATCH,
    )
    profile = dataclasses.replace(H200_FP16, name=f"{H200_FP16.name}-{name}", queued=queued)
    return SimulatedDevice(FunctionRunner(lambda x: x, spec), profile)


async def serve(
    instances: int, clients: int, seconds: float, queued: bool
) -> dict[str, float | int]:
    runner = device(f"{os.getpid()}-{instances}", queued)
    policy = BatchingPolicy(
        max_batch_size=MAX_BATCH, preferred_batch_sizes=(MAX_BATCH,), max_queue_delay_us=2000
    )
    batcher = Batcher(runner, policy, instance_count=instances, name="sim_h200")
    rng = np.random.default_rng(0)
    done = 0
    stop = 0.0

    async def client(c: int) -> None:
        nonlocal done
        own = [rng.random((1, *IMAGE), np.float32) for _ in range(2)]  # its own bytes
        k = 0
        while time.perf_counter() < stop:
            out = await batcher.infer({"input": own[k % 2]})
            assert out["logits"].shape == (1, 1000)
            done += 1
            k += 1

    stop = time.perf_counter() + 1.0  # warm: threads, buffers
    await asyncio.gather(*(client(c) for c in range(clients)))
    done = 0
    cpu0, start = time.process_time(), time.perf_counter()
    stop = start + seconds
    await asyncio.gather(*(client(c) for c in range(clients)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu0
    await batcher.aclose()
    runner.close()
    ceiling = H200_FP16.ceiling(MAX_BATCH)
    rate = done / elapsed
    return {
        "instances": instances,
        "images_per_s": round(rate, 1),
        "ceiling_images_per_s": round(ceiling, 1),
        "share": round(rate / ceiling, 4),
        "cpu_us_per_request": round(cpu / max(done, 1) * 1e6, 1),
        "mean_batch": round(
            batcher.stats.inference_count / max(batcher.stats.execution_count, 1), 1
        ),
    }


def _concat(self: Staging, inputs: list, names: list) -> dict[str, np.ndarray]:
    return concat(inputs, names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--instances", default="1,2")
    ap.add_argument("--gather", default="concat,staging", help="concat: the path before staging")
    ap.add_argument("--lock", action="store_true", help="a device taken by a host thread")
    ap.add_argument("--out", type=Path, default=Path("bench/results/host_path.json"))
    args = ap.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    rows = []
    staged = Staging.gather
    for gather in args.gather.split(","):
        Staging.gather = staged if gather == "staging" else _concat  # type: ignore[method-assign]
        for n in (int(i) for i in args.instances.split(",")):
            row = {
                "gather": gather,
                **asyncio.run(serve(n, args.clients, args.seconds, not args.lock)),
            }
            rows.append(row)
            print(
                f"{gather}, {n} instance(s): {row['images_per_s']:,.0f} images/s = "
                f"{100 * row['share']:.1f} % of {row['ceiling_images_per_s']:,.0f}; "
                f"mean batch {row['mean_batch']}; {row['cpu_us_per_request']} us CPU/request",
                flush=True,
            )
    Staging.gather = staged  # type: ignore[method-assign]
    result = {
        "commit": commit,
        "host": platform.node(),
        "cores": os.cpu_count(),
        "clients": args.clients,
        "device": "lock" if args.lock else "queued",
        "seconds": args.seconds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
