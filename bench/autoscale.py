"""The autoscaling signal under a load ramp (issue: operations made real).

A native server runs a simulated T4 (``sim_t4`` at ``--scale`` times the T4's ResNet-50
INT8 time, so two CPU cores can drive it past its capacity) with ``--instances``
instances and a latency budget of ``--budget-ms``. An open-loop client (Poisson
arrivals, binary tensors over HTTP) ramps the offered rate from ``--low`` to ``--high``
requests/s, holds it, ramps back down and stays low a while; past ``--max-queue-size``
waiting requests the server sheds load (503), as a server in production should. Every second the bench reads the server's
``servekit_replicas_needed`` from its ``/metrics`` (what Prometheus would scrape) and
the p99 of the requests that completed in that second. The plot puts the signal beside
the offered load and the p99: the signal should pass 1 (ask for another replica) before
the p99 crosses the budget, and fall back below 1 once the ramp is over.

    python bench/autoscale.py --out bench/results/autoscale
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from servekit import BatchingPolicy, ModelConfig, QueuePolicy, ServeConfig, ServerConfig
from servekit.autoscale import AutoscalePolicy
from servekit.bench.openload import OpenLoad
from servekit.bench.report import machine
from servekit.native import NativeServer
from servekit.window import percentile
from servekit.zoo.tiny import build_sim_t4


def rate_at(t: float, args: argparse.Namespace) -> float:
    """The ramp: up over ``--up-s``, held ``--hold-s``, down over ``--down-s``."""
    if t < args.up_s:
        return args.low + (args.high - args.low) * t / args.up_s
    if t < args.up_s + args.hold_s:
        return args.high
    down = t - args.up_s - args.hold_s
    return max(args.low, args.high - (args.high - args.low) * down / args.down_s)  # then low


def needed(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return sum(
        float(v) for v in re.findall(r"^servekit_replicas_needed\{[^}]*\} (\S+)$", text, re.M)
    )


async def drive(args: argparse.Namespace, url: str, metrics_url: str) -> list[dict]:
    x = {"input": np.random.default_rng(0).random((1, 64, 64, 3), dtype=np.float32)}
    total_s = args.up_s + args.hold_s + args.down_s + args.tail_s
    load = OpenLoad(url, "sim", x, lambda t: rate_at(t, args), total_s, clients=4)
    rows: list[dict] = []

    async def sample(load: OpenLoad) -> None:
        done = load.done  # (sent, latency, answered): counted in the second it came back
        for second in range(1, int(total_s) + 1):
            await asyncio.sleep(max(0.0, load.start + second - time.perf_counter()))
            back = [(lat, ok) for s, lat, ok in done if second - 1 <= s + lat < second]
            window = [lat for lat, ok in back if ok]
            rows.append({
                "t": second,
                "offered": sum(1 for s in load.sent if second - 1 <= s < second),
                "answered": len(window),
                "failed": sum(1 for _, ok in back if not ok),
                "p99_ms": percentile(sorted(window), 99) * 1e3 if window else None,
                "needed": await asyncio.to_thread(needed, metrics_url),
            })  # fmt: skip

    await load.run(sample)
    return rows


def plot(rows: list[dict], budget_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, (a, b, c) = plt.subplots(3, 1, sharex=True, figsize=(9, 8))
    a.plot(t, [r["offered"] for r in rows], label="offered")
    a.plot(t, [r["answered"] for r in rows], label="answered")
    a.set_ylabel("requests/s")
    a.legend()
    b.plot(t, [r["p99_ms"] for r in rows], color="tab:red", label="p99 (per second)")
    b.axhline(budget_ms, color="gray", linestyle="--", label=f"budget {budget_ms:g} ms")
    b.set_ylabel("ms")
    b.set_yscale("log")
    b.legend()
    c.plot(t, [r["needed"] for r in rows], color="tab:green", label="servekit_replicas_needed")
    c.axhline(1, color="gray", linestyle="--", label="one replica")
    c.set_ylabel("replicas")
    c.set_xlabel("seconds")
    c.legend()
    fig.suptitle("The autoscaling signal under a load ramp (native, simulated T4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=32.0)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--budget-ms", type=float, default=300.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--low", type=float, default=10.0)
    parser.add_argument("--high", type=float, default=200.0)
    parser.add_argument("--up-s", type=float, default=60.0)
    parser.add_argument("--hold-s", type=float, default=10.0)
    parser.add_argument("--down-s", type=float, default=30.0)
    parser.add_argument("--tail-s", type=float, default=30.0)
    parser.add_argument("--max-queue-size", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results/autoscale"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sim.onnx"
        path.write_bytes(build_sim_t4(scale=args.scale).SerializeToString())
        policy = AutoscalePolicy(latency_budget_ms=args.budget_ms, window_s=args.window_s)
        config = ServeConfig(
            (ModelConfig(str(path), "sim", image=False, instances=args.instances,
                         batching=BatchingPolicy(
                             max_batch_size=args.max_batch_size, max_queue_delay_us=2000,
                             default_queue_policy=QueuePolicy(max_queue_size=args.max_queue_size)),
                         autoscale=policy),),
            ServerConfig(exit_timeout_s=2), runtime="native",
        ).on_loopback()  # fmt: skip
        with NativeServer(config):
            rows = asyncio.run(drive(args, config.server.http_url, config.server.metrics_url))
    over = [r["t"] for r in rows if r["p99_ms"] is not None and r["p99_ms"] > args.budget_ms]
    asks = [r["t"] for r in rows if r["needed"] > 1]
    peak = args.up_s + args.hold_s
    result = {
        "machine": machine(),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "first_second_needed_over_1": asks[0] if asks else None,
        "first_second_p99_over_budget": over[0] if over else None,
        "last_second_needed_over_1": asks[-1] if asks else None,
        "needed_at_end": rows[-1]["needed"],
        "peak_needed": max(r["needed"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
        "ramp_down_starts_s": peak,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(rows, args.budget_ms, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
