"""ResNet-50 on a CUDA GPU through servekit's TorchRunner: raw and served images/s.

    bash bench/gpu.sh                     # on the device machine; writes $OUT/gpu.json

Raw: the runner's CUDA graph for each batch size, replayed back to back on device
tensors (the engine alone), and the same through ``runner.infer`` from host numpy
arrays (copies in and out, as a server pays them). Served: one-image requests from
``--clients`` asyncio tasks through servekit's ``Batcher`` (max batch 128, preferred
64/128) at each of ``--instances`` (Batcher instances, and as many lanes of the runner:
a stream, graphs and buffers each, fed from its pinned staging); the served figure over
the engine's at batch 128 is the device's busy share. FP32 runs with TF32 off, FP16 and BF16 with
channels_last. Weights are the zoo's seeded ResNet-50: throughput does not depend on them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import torch

from servekit import Batcher, BatchingPolicy, zoo
from servekit.bench import rows_per_s
from servekit.runners.torch import TorchRunner, serving_backends
from servekit.window import percentiles

BATCHES = (1, 8, 32, 64, 128, 256)


def engine_images_per_s(runner: TorchRunner, batch: int, seconds: float) -> float:
    runner.replay(batch, 1)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        runner.replay(batch, 10)
        n += 10 * batch
    return n / (time.perf_counter() - start)


def runner_images_per_s(runner: TorchRunner, batch: int, seconds: float) -> float:
    x = runner.spec.sample_inputs(batch)
    return rows_per_s(lambda: runner.infer(x), batch, seconds)


async def served_images_per_s(
    runner: TorchRunner, clients: int, seconds: float, most: int, instances: int
) -> dict[str, float]:
    """``runner`` must keep ``instances`` lanes (``TorchRunner(instances=)``)."""
    preferred = tuple(b for b in (64, 128) if b <= most) or (most,)
    policy = BatchingPolicy(
        max_batch_size=min(128, most), preferred_batch_sizes=preferred, max_queue_delay_us=2000
    )
    batcher = Batcher(runner, policy, instance_count=instances, name="resnet50")
    x = runner.spec.sample_inputs(1)
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def client() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await batcher.infer(x)
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(client() for _ in range(min(clients, 64))))  # warm-up pass
    latencies.clear()
    stop = time.perf_counter() + seconds
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    await batcher.aclose()
    p50, p99 = percentiles((t * 1e3 for t in latencies), (50, 99))
    return {
        "images_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=512)
    ap.add_argument("--precisions", default="fp32,fp16,bf16")
    ap.add_argument("--instances", default="1,2", help="Batcher instances, each served apart")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu.json"))
    args = ap.parse_args()
    batches = tuple(int(b) for b in args.batches.split(","))
    cuda = args.device.startswith("cuda")
    serving_backends(torch)  # what TorchRunner serves with, so the ceiling is the served one
    model = zoo.build("resnet50")
    result: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "batches": list(batches),
        "precisions": {},
    }
    for precision in args.precisions.split(","):

        def runner_of(instances: int, precision: str = precision) -> TorchRunner:
            return TorchRunner(
                model,
                device=args.device,
                precision=precision,
                max_batch_size=max(batches),
                preferred_batch_sizes=batches,
                instances=instances,
            )

        start = time.perf_counter()
        runner = runner_of(1)
        row = {
            "capture_s": round(time.perf_counter() - start, 1),
            "engine_images_per_s": {
                b: round(engine_images_per_s(runner, b, args.seconds), 1) if cuda else None
                for b in batches
            },
            "runner_images_per_s": {
                b: round(runner_images_per_s(runner, b, args.seconds), 1) for b in batches
            },
            "served": {},
        }
        runner.close()
        for n in (int(i) for i in args.instances.split(",")):
            lanes = runner_of(n)
            row["served"][n] = asyncio.run(  # type: ignore[index]
                served_images_per_s(lanes, args.clients, 2 * args.seconds, max(batches), n)
            )
            lanes.close()
        result["precisions"][precision] = row  # type: ignore[index]
        print(precision, json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    _table(result)


def _table(result: dict[str, object]) -> None:
    batches = result["batches"]
    print(
        f"\nResNet-50 on {result['gpu']} (torch {result['torch']}, CUDA {result['cuda']}), images/s"
    )
    print("| precision | what | " + " | ".join(f"batch {b}" for b in batches) + " |")  # type: ignore[attr-defined]
    print("| --- | --- |" + " ---: |" * len(batches))  # type: ignore[arg-type]
    for precision, row in result["precisions"].items():  # type: ignore[union-attr]
        for what in ("engine", "runner"):
            cells = " | ".join(str(row[f"{what}_images_per_s"][b]) for b in batches)  # type: ignore[attr-defined]
            print(f"| {precision} | {what} | {cells} |")
    top = min(128, max(batches))  # type: ignore[call-overload]  # the served max batch
    for precision, row in result["precisions"].items():  # type: ignore[union-attr]
        for n, s in row["served"].items():
            ceiling = row["engine_images_per_s"][top] or row["runner_images_per_s"][top]
            print(
                f"served {precision}, {n} instance(s): {s['images_per_s']} images/s "
                f"({100 * s['images_per_s'] / ceiling:.1f} % of batch {top}'s), "
                f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms"
            )


if __name__ == "__main__":
    main()
