"""Batching that holds a latency budget by itself, against fixed configurations (issue:
batching that holds a latency budget).

A native server runs a simulated T4 (``sim_t4`` at ``--scale`` times the T4's ResNet-50
INT8 time: 8 ms + 1.6 ms a row at the default 8, so a full batch of 32 takes 59.2 ms and
the device serves 540 rows/s at most) with one instance. An open-loop client (Poisson
arrivals, one row per request, binary tensors over HTTP) steps the offered rate through
``--steps`` shares of the capacity, ``--step-s`` seconds each: by default the ceiling
measured in the same run (closed loop, full batches, no delay), which the HTTP path on
a small machine holds below the device's own. The same load runs against
the adaptive batcher (``latency_budget_ms = --budget-ms``) and against each fixed
configuration of a grid (max batch size x queue delay), one server each, in one run.

Per step, after ``--settle-s``: rows per second answered in it, the p99 of the requests
sent in it, and failures. For each step, the best fixed configuration is the one with
the most rows per second among those whose p99 is within the budget (the lowest p99 on a
tie within 1 %). The table and the plot go to ``--out`` (.json, .md, .png).

    python bench/budget.py --out bench/results/budget
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig
from servekit.bench.openload import OpenLoad
from servekit.bench.report import machine
from servekit.client import AsyncClient
from servekit.native import NativeServer
from servekit.window import percentile
from servekit.zoo.tiny import SIM_T4, build_sim_t4


def gauge(metrics_url: str, name: str) -> float | None:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


async def drive(args: argparse.Namespace, rates: list[float], url: str, metrics_url: str) -> dict:
    """The stepped Poisson load; per step its figures, and a per-second trace."""
    x = {"input": np.random.default_rng(0).random((1, 64, 64, 3), dtype=np.float32)}
    total_s = args.step_s * len(rates)

    def rate_at(t: float) -> float:
        return rates[min(int(t // args.step_s), len(rates) - 1)]

    load = OpenLoad(url, "sim", x, rate_at, total_s)
    trace: list[dict] = []

    async def sample(load: OpenLoad) -> None:
        for second in range(1, int(total_s) + 1):
            await asyncio.sleep(max(0.0, load.start + second - time.perf_counter()))
            target = await asyncio.to_thread(gauge, metrics_url, "servekit_batch_target_rows")
            needed = await asyncio.to_thread(gauge, metrics_url, "servekit_replicas_needed")
            trace.append({"t": second, "target_rows": target, "replicas_needed": needed})

    await load.run(sample)
    done = load.done
    for row in trace:  # the p99 of the requests sent in each second
        sent = sorted(lat for s, lat, ok in done if row["t"] - 1 <= s < row["t"] and ok)
        row["p99_ms"] = percentile(sent, 99) * 1e3 if sent else None
    steps = []
    for i, rate in enumerate(rates):
        lo, hi = i * args.step_s + args.settle_s, (i + 1) * args.step_s
        sent = [(lat, ok) for s, lat, ok in done if lo <= s < hi]
        ok = sorted(lat for lat, good in sent if good)
        answered = sum(1 for s, lat, good in done if good and lo <= s + lat < hi)
        steps.append({
            "offered_per_s": rate,
            "rows_per_s": answered / (hi - lo),
            "p99_ms": percentile(ok, 99) * 1e3 if ok else None,
            "p50_ms": percentile(ok, 50) * 1e3 if ok else None,
            "failed": sum(1 for _, good in sent if not good),
        })  # fmt: skip
    return {"steps": steps, "trace": trace}


async def closed(url: str, clients: int, seconds: float) -> float:
    """Rows per second ``clients`` closed-loop clients get: the server's ceiling."""
    x = {"input": np.random.default_rng(0).random((1, 64, 64, 3), dtype=np.float32)}
    pool = [AsyncClient(url, timeout_s=60) for _ in range(8)]
    prepared = pool[0].prepare(x)
    answered = 0
    end = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        nonlocal answered
        while time.perf_counter() < end:
            await pool[k % len(pool)].infer_prepared("sim", prepared)
            answered += 1

    await asyncio.gather(*(worker(k) for k in range(clients)))
    for c in pool:
        await c.close()
    return answered / seconds


def config_of(path: Path, batching: BatchingPolicy, instances: int = 1) -> ServeConfig:
    return ServeConfig(
        (ModelConfig(str(path), "sim", image=False, batching=batching, instances=instances),),
        ServerConfig(exit_timeout_s=2), runtime="native",
    ).on_loopback()  # fmt: skip


def ceiling(args: argparse.Namespace, path: Path) -> float:
    """The most rows a second the server answers here (full batches, no delay), measured
    with 4 x max_batch_size closed-loop clients after a warm-up."""
    config = config_of(path, BatchingPolicy(args.max_batch_size), args.instances)
    with NativeServer(config):
        url = config.server.http_url
        asyncio.run(closed(url, 4 * args.max_batch_size, 3.0))
        return asyncio.run(closed(url, 4 * args.max_batch_size, args.ceiling_s))


def serve(args: argparse.Namespace, path: Path, batching: BatchingPolicy, rates: list[float]):
    config = config_of(path, batching, args.instances)
    with NativeServer(config):
        return asyncio.run(drive(args, rates, config.server.http_url, config.server.metrics_url))


def label(b: BatchingPolicy) -> str:
    if b.latency_budget_ms:
        return f"adaptive (budget {b.latency_budget_ms:g} ms, batch <= {b.max_batch_size})"
    return f"fixed batch {b.max_batch_size}, delay {b.max_queue_delay_us / 1e3:g} ms"


def best_fixed(results: dict[str, dict], step: int, budget_ms: float) -> str | None:
    within = [
        (name, r["steps"][step])
        for name, r in results.items()
        if not name.startswith("adaptive")
        and r["steps"][step]["p99_ms"] is not None
        and r["steps"][step]["p99_ms"] <= budget_ms
    ]
    if not within:
        return None
    most = max(s["rows_per_s"] for _, s in within)
    close = [(name, s) for name, s in within if s["rows_per_s"] >= 0.99 * most]
    return min(close, key=lambda item: item[1]["p99_ms"])[0]


def table(results: dict[str, dict], rates: list[float], args: argparse.Namespace) -> str:
    shares = [f"{s:g} x" for s in args.steps]
    head = "| configuration | " + " | ".join(
        f"step {i + 1} ({share} capacity, {rate:.0f}/s): rows/s, p99 ms" for i, (share, rate) in
        enumerate(zip(shares, rates, strict=True))
    ) + " |"  # fmt: skip
    lines = [head, "|" + " --- |" * (1 + len(rates))]
    best = [best_fixed(results, i, args.budget_ms) for i in range(len(rates))]
    for name, r in results.items():
        cells = []
        for i, s in enumerate(r["steps"]):
            p99 = "-" if s["p99_ms"] is None else f"{s['p99_ms']:.1f}"
            miss = " (over budget)" if s["p99_ms"] is None or s["p99_ms"] > args.budget_ms else ""
            mark = " (best fixed)" if name == best[i] else ""
            cells.append(f"{s['rows_per_s']:.1f}, {p99}{miss}{mark}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, sharex=True, figsize=(10, 8))
    for name, r in results.items():
        t = [row["t"] for row in r["trace"]]
        style = {"linewidth": 2.5, "color": "black"} if name.startswith("adaptive") else {}
        a.plot(t, [row["p99_ms"] for row in r["trace"]], label=name, **style)
    a.axhline(args.budget_ms, color="gray", linestyle="--", label=f"budget {args.budget_ms:g} ms")
    a.set_yscale("log")
    a.set_ylabel("p99 of requests sent that second (ms)")
    a.legend(fontsize=7, ncol=2)
    adaptive = next(r for n, r in results.items() if n.startswith("adaptive"))
    t = [row["t"] for row in adaptive["trace"]]
    b.plot(t, [row["target_rows"] for row in adaptive["trace"]], label="target rows (adaptive)")
    b.plot(t, [row["replicas_needed"] for row in adaptive["trace"]], label="replicas needed")
    b.set_xlabel("seconds")
    b.legend()
    for i in range(1, len(args.steps)):
        for ax in (a, b):
            ax.axvline(i * args.step_s, color="lightgray")
    fig.suptitle(f"Latency budget {args.budget_ms:g} ms on a simulated T4: steps {args.steps}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=8.0)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument(
        "--instances", type=int, default=1, help="instances sharing the one simulated device"
    )
    parser.add_argument("--budget-ms", type=float, default=100.0)
    parser.add_argument("--steps", type=float, nargs="+", default=[0.2, 0.9, 0.4])
    parser.add_argument("--step-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=5.0)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--delays-ms", type=float, nargs="+", default=[0, 10, 40])
    parser.add_argument(
        "--capacity", choices=["measured", "device"], default="measured",
        help="the steps' 100 %%: the server's ceiling measured here, or the device's own",
    )  # fmt: skip
    parser.add_argument("--ceiling-s", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/budget"))
    args = parser.parse_args()
    fixed_us, per_row_us = (v * args.scale for v in SIM_T4)
    device = args.max_batch_size / ((fixed_us + per_row_us * args.max_batch_size) / 1e6)
    policies = [BatchingPolicy(args.max_batch_size, latency_budget_ms=args.budget_ms)] + [
        BatchingPolicy(b, max_queue_delay_us=round(d * 1e3))
        for b in args.batches
        for d in args.delays_ms
    ]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sim.onnx"
        path.write_bytes(build_sim_t4(scale=args.scale).SerializeToString())
        capacity = device if args.capacity == "device" else ceiling(args, path)
        print(f"capacity {capacity:.1f} rows/s (the device alone: {device:.1f})", flush=True)
        rates = [share * capacity for share in args.steps]
        for policy in policies:
            results[label(policy)] = serve(args, path, policy, rates)
            print(label(policy), json.dumps(results[label(policy)]["steps"]), flush=True)
    text = table(results, rates, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({
        "machine": machine(), "capacity_rows_per_s": capacity, "device_rows_per_s": device,
        "rates": rates,
        "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results,
    }, indent=1))  # fmt: skip
    args.out.with_suffix(".md").write_text(text + "\n")
    plot(results, args, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
