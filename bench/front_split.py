"""Where the triton front's cost goes: server CPU per request split by process (servekit's
front, tritonserver, the Python backend stubs), over HTTP binary and gRPC, in one run.

One ``servekit serve --runtime triton`` (front on) serving add_sub; eight clients of
servekit's load generator, closed loop, per protocol in turn for ``--rounds`` rounds. Each
process's user+system CPU over the measured windows, divided by the requests answered in
them. Run it with ``PYTHONPATH=<another checkout>/src`` to measure that checkout's front
(the server is a subprocess and inherits it).

    python bench/front_split.py [--rounds 2] [--out bench/results/front_split]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import psutil

from servekit import BatchingPolicy, ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench import MeasureConfig
from servekit.bench.compare import ServerProcess, Setup
from servekit.bench.loadgen import closed_loop
from servekit.bench.report import machine
from servekit.bench.targets import open_target


def cpu_by_process(pid: int) -> dict[str, float]:
    """CPU seconds so far of ``pid``'s tree, summed by what each process is."""
    root = psutil.Process(pid)
    out: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            argv0, times = (p.cmdline() or [""])[0], p.cpu_times()
        except psutil.Error:
            continue
        kind = "stubs" if "stub" in argv0 else "tritonserver" if p.name() == "tritonserver" else ""
        kind = kind or ("front" if p.pid == pid else p.name())
        out[kind] = out.get(kind, 0.0) + times.user + times.system
    return out


async def one(url: str, setup: Setup, pid: int) -> dict[str, float]:
    target = open_target(url, setup.target, setup.payload, binary=True)
    warm = MeasureConfig(window_s=1.0, warmup_s=0.5, max_windows=3, stability=0.9)
    measured = MeasureConfig(window_s=5.0, warmup_s=0.0, max_windows=3, stability=0.9)
    try:
        await closed_loop(target, 8, warm)
        before, start = cpu_by_process(pid), time.perf_counter()
        point = await closed_loop(target, 8, measured)
        after, seconds = cpu_by_process(pid), time.perf_counter() - start
    finally:
        await target.close()
    n = point.stats.requests
    row = {k: 1e6 * (after[k] - before.get(k, 0.0)) / n for k in after}
    return row | {"requests_per_s": n / seconds, "total": sum(row.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/front_split"))
    args = ap.parse_args()
    path = zoo.resolve("add_sub")
    model = ModelConfig(str(path), batching=BatchingPolicy(max_batch_size=8))
    setup = Setup.of(model)
    config = ServeConfig(
        (model,), ServerConfig(front=True, exit_timeout_s=2), runtime="triton"
    ).on_loopback()
    urls = {"http-binary": config.server.http_url, "grpc": config.server.grpc_url}
    rows: list[dict[str, object]] = []
    with ServerProcess(config) as server:
        server.wait_ready([setup.target])
        for r in range(args.rounds):
            for protocol, url in urls.items():
                if protocol == "grpc":
                    url = url.replace("http://", "grpc://")
                row = {
                    "round": r + 1,
                    "protocol": protocol,
                    **asyncio.run(one(url, setup, server.pid)),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps({"command": command, "machine": machine(), "rows": rows}, indent=2)
    )
    kinds = sorted(
        {k for row in rows for k in row} - {"round", "protocol", "requests_per_s", "total"}
    )
    lines = [
        f"`{command}` on {machine()}: add_sub, 8 clients, closed loop; server CPU us/request",
        "",
        "| round | protocol | requests/s | " + " | ".join(kinds) + " | total |",
        "| ---: | --- | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |",
    ]
    for row in rows:
        cells = " | ".join(f"{row.get(k, 0.0):.0f}" for k in kinds)
        lines.append(
            f"| {row['round']} | {row['protocol']} | {row['requests_per_s']:.0f} | {cells} "
            f"| {row['total']:.0f} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
