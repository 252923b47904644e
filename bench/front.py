"""What servekit's hardened HTTP front costs: PyTriton's own HTTP port against the front.

Same server (PyTriton, Triton's dynamic batcher, max batch 8), same client (servekit's
load generator over HTTP with binary tensors, closed loop), started once with
``front=False`` (Triton's HTTP endpoint public) and once with ``front=True`` (servekit's
KServe front on the port, forwarding over gRPC on loopback). Two models: the zoo's
tiny_cnn, where the extra hop is most of the work, and ResNet-50, where it is not.

    python bench/front.py [--concurrency 1,4,16] [--out bench/results/front.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
from pathlib import Path

import numpy as np

from servekit import BatchingPolicy, zoo
from servekit.bench import MeasureConfig, open_target, parse_levels, sweep
from servekit.config import ModelConfig, ServerConfig
from servekit.pytriton import TritonServer
from servekit.runtime import load_models


def measure(model: str, front: bool, levels: list[float], cfg: MeasureConfig) -> list[dict]:
    path = zoo.build(model)
    config = ServerConfig.on_loopback(
        exit_timeout_s=2,
        front=front,
    )
    models = load_models(ModelConfig(str(path), model, batching=BatchingPolicy(max_batch_size=8)))
    shape = models[0].runner.spec.inputs[0].shape
    x = {"input": np.random.default_rng(1).standard_normal((1, *shape)).astype(np.float32)}
    with TritonServer(models, config):

        async def run():
            target = open_target(config.http_url, model, x)
            try:
                return await sweep(target, levels, "concurrency", cfg)
            finally:
                await target.close()

        points = asyncio.run(run())
    return [
        {
            "concurrency": p.level,
            "inferences_per_s": round(p.stats.inferences_per_s, 1),
            "p50_ms": round(p.stats.p50_ms, 2),
            "p99_ms": round(p.stats.p99_ms, 2),
            "errors": p.stats.errors,
            "stable": p.stable,
        }
        for p in points
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--models", default="tiny_cnn,resnet50")
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/front.json"))
    args = ap.parse_args()
    cfg = MeasureConfig(window_s=args.window, warmup_s=1.0, max_windows=5)
    levels = parse_levels(args.concurrency)
    result: dict[str, object] = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus"}
    print(
        "| model | concurrency | Triton HTTP inf/s | front inf/s | front/Triton | Triton p50 ms | front p50 ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for model in args.models.split(","):
        plain = measure(model, False, levels, cfg)
        fronted = measure(model, True, levels, cfg)
        result[model] = {"triton_http": plain, "front": fronted}
        for a, b in zip(plain, fronted, strict=True):
            ratio = b["inferences_per_s"] / a["inferences_per_s"] if a["inferences_per_s"] else 0
            print(
                f"| {model} | {a['concurrency']} | {a['inferences_per_s']} | {b['inferences_per_s']} "
                f"| {ratio:.2f} | {a['p50_ms']} | {b['p50_ms']} |",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
