"""Serving cost per request on every runtime and protocol (issue: the serving path's cost).

Each runtime is started as ``servekit serve --config`` in its own process on loopback
with the same trivial model (``add_sub``: two FP32 [16] inputs), then driven closed loop
at one concurrency over HTTP JSON, HTTP binary tensors and gRPC (where the port offers
it). The servers of a group (Triton, PyTriton and native; the Ray apps) run at once and
the group's rows are measured in turn, ``--rounds`` times: each row is its median
round, so the VM's drift falls on every row of a group alike. Reported per request: the server's CPU (its whole process tree: tritonserver and
its stubs, Ray's processes) and the client's, beside throughput and latency. Peers:
tritonserver's own ports (``front = false``) and a plain Ray Serve app
(bench/plain_ray_app.py, HTTP JSON). With ``--rate`` every row is driven open loop at
that many requests/s instead: the same load on each, so a server whose cost per request
depends on how full its batches are is compared at equal batching.

    python bench/serving_cost.py --out bench/results/serving_cost
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from servekit import BatchingPolicy, Client, ModelConfig, ServeConfig, ServerConfig, zoo
from servekit.bench import MeasureConfig
from servekit.bench.compare import ServerProcess, Setup, spawned
from servekit.bench.loadgen import closed_loop, open_loop
from servekit.bench.report import machine as report_machine
from servekit.bench.targets import open_target
from servekit.config import RayOptions
from servekit.endpoints import free_port
from servekit.rollout import ModelVersion, TrafficPolicy

PROTOCOLS = ("http-json", "http-binary", "grpc")
SPLIT = ", two versions split 50/50"
SHADOW = ", every request shadowed on a second version"

RUNS = [
    # (row name, runtime, front, protocols); the Ray rows are a group of their own (below)
    ("native", "native", True, PROTOCOLS),
    ("native" + SPLIT, "native", True, PROTOCOLS),
    ("native" + SHADOW, "native", True, PROTOCOLS),
    ("pytriton (front)", "pytriton", True, PROTOCOLS),
    ("pytriton --no-front (Triton's own ports)", "pytriton", False, PROTOCOLS),
    ("triton (front)", "triton", True, PROTOCOLS),
    ("triton (front)" + SPLIT, "triton", True, PROTOCOLS),
    ("triton (front)" + SHADOW, "triton", True, PROTOCOLS),
    ("triton --no-front (tritonserver's own ports)", "triton", False, PROTOCOLS),
    ("ray", "ray", True, ("http-json", "http-binary")),
    ("ray, fused ([ray] fuse = true)", "ray", True, ("http-json", "http-binary")),
]


@contextlib.contextmanager
def plain_ray(model: Path, name: str, max_batch_size: int) -> Iterator[tuple[str, int]]:
    port = free_port()
    script = Path(__file__).with_name("plain_ray_app.py")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        with Client(url) as c:
            return c.is_ready(name)

    argv = [sys.executable, str(script), "--model", str(model), "--name", name,
            "--port", str(port), "--max-batch-size", str(max_batch_size)]  # fmt: skip
    with spawned(argv, ready, "the plain Ray app") as pid:
        yield url, pid


def measure(
    url: str, model: str, payload, protocol: str, cfg: MeasureConfig, level: int,
    rate: float = 0.0,
):  # fmt: skip
    """Closed loop at concurrency ``level``, or open loop at ``rate`` requests/s when set."""
    if protocol == "grpc":
        url = url.replace("http://", "grpc://")

    async def run():
        target = open_target(url, model, payload, binary=protocol != "http-json")
        try:
            if rate:
                return await open_loop(target, rate, cfg)
            return await closed_loop(target, level, cfg)
        finally:
            await target.close()

    return asyncio.run(run())


def row(name: str, protocol: str, point) -> dict:
    s = point.stats
    return {
        "runtime": name,
        "protocol": protocol,
        "requests_per_s": s.throughput,
        "p50_ms": s.p50_ms,
        "p99_ms": s.p99_ms,
        "errors": s.errors,
        "server_cpu_us": point.server_cpu_us,
        "client_cpu_us": point.client_cpu_us,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="add_sub")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--rate", type=float, default=0.0,
        help="Open loop at this many requests/s instead (every row at the same load).",
    )  # fmt: skip
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="Rows measured in turn, this many times.")
    ap.add_argument("--only", default="", help="Comma-separated row names to run (default all).")
    ap.add_argument("--out", type=Path, default=Path("bench/results/serving_cost"))
    args = ap.parse_args()

    path = zoo.resolve(args.model)
    model = ModelConfig(str(path), batching=BatchingPolicy(max_batch_size=args.max_batch_size))
    setup = Setup.of(model)
    cfg = MeasureConfig(window_s=args.window, warmup_s=1.0, max_windows=4, stability=0.15)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    # The servers of a group run at once and its rows are measured in turn, round after
    # round, so this VM's drift falls on every row alike; each row reports its median
    # round. Ray's rows are a group of their own: a Ray cluster's background work would
    # slow every other server on two cores.
    rounds: dict[tuple[str, str], list[dict]] = {}
    groups = [
        [r for r in RUNS if r[1] != "ray"],
        [r for r in RUNS if r[1] == "ray"] + [("plain-ray", "plain", True, ("http-json",))],
    ]
    for group in groups:
        chosen = [r for r in group if not only or r[1] in only or r[0] in only]
        if chosen:
            measure_group(chosen, model, path, setup, cfg, args, rounds)
    rows = [median_row(measured) for measured in rounds.values()]
    machine = report_machine()
    command = "python " + " ".join(sys.argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"command": command, "machine": machine, "rows": rows, "rounds": list(rounds.values())},
            indent=2,
        )
    )
    lines = [
        f"`{command}` on {machine}: `{setup.target}`, "
        + (
            f"open loop at {args.rate:g} requests/s"
            if args.rate
            else f"closed loop at concurrency {args.concurrency}"
        )
        + f", max_batch_size {args.max_batch_size}; each row is the median "
        f"of {args.rounds} rounds (server CPU's range beside it).",
        "",
        *cost_table(rows, ("runtime", "runtime"), ("protocol", "protocol")),
    ]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cost_table(rows: list[dict], *first: tuple[str, str]) -> list[str]:
    """Markdown rows of ``median_row``s: the ``first`` columns (header, key), then
    throughput, latency, errors and CPU per request with its range over the rounds."""
    header = [h for h, _ in first] + [
        "requests/s", "p50 ms", "p99 ms", "errors", "server CPU us/request", "range",
        "client CPU us/request",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(first) + " ---: |" * 7]
    for r in rows:
        cells = [str(r[key]) for _, key in first] + [
            f"{r['requests_per_s']:.0f}", f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
            str(r["errors"]), f"{r['server_cpu_us']:.0f}",
            f"{r['server_cpu_min']:.0f}-{r['server_cpu_max']:.0f}", f"{r['client_cpu_us']:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def measure_group(group, model, path, setup, cfg, args, rounds) -> None:
    """Start every server of ``group``, then measure its rows in turn, ``args.rounds`` times."""
    targets: list[tuple[str, str, str, int]] = []  # (row, protocol, url, server pid)
    with contextlib.ExitStack() as stack:
        for name, runtime, front, protocols in group:
            if runtime == "plain":
                print("starting the plain Ray Serve app", flush=True)
                url, pid = stack.enter_context(plain_ray(path, setup.target, args.max_batch_size))
                targets.append(("plain Ray Serve app (@serve.batch, JSON)", "http-json", url, pid))
                continue
            config = ServeConfig(
                (rollout(model, name),),
                ServerConfig(front=front, exit_timeout_s=2),
                runtime=runtime,
                ray=(
                    RayOptions(model_cpus=0.5, fuse="fuse" in name)
                    if runtime == "ray"
                    else RayOptions()
                ),
            ).on_loopback()
            print(f"starting {name}", flush=True)
            server = stack.enter_context(ServerProcess(config))
            server.wait_ready([setup.target])
            for protocol in protocols:
                url = config.server.http_url if protocol != "grpc" else config.server.grpc_url
                targets.append((name, protocol, url, server.pid))
        for r in range(args.rounds):
            for name, protocol, url, pid in targets:
                point = measure(
                    url, setup.target, setup.payload, protocol,
                    dataclasses.replace(cfg, server_pid=pid), args.concurrency, args.rate,
                )  # fmt: skip
                rounds.setdefault((name, protocol), []).append(row(name, protocol, point))
                print(f"round {r + 1}: {json.dumps(rounds[name, protocol][-1])}", flush=True)


def rollout(model: ModelConfig, row: str) -> ModelConfig:
    """The model as the row serves it: the rollout rows add version 2 (the same file), split
    50/50, or all answered by version 1 with every request shadowed on version 2."""
    if not row.endswith((SPLIT, SHADOW)):
        return model
    traffic = (
        TrafficPolicy({1: 50, 2: 50}) if row.endswith(SPLIT) else TrafficPolicy({1: 100}, shadow=2)
    )
    return dataclasses.replace(model, versions=(ModelVersion(2, model.source),), traffic=traffic)


def median_row(measured: list[dict]) -> dict:
    """The round with the median server CPU per request, with the rounds' range."""
    ordered = sorted(measured, key=lambda r: r["server_cpu_us"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    out["server_cpu_min"] = ordered[0]["server_cpu_us"]
    out["server_cpu_max"] = ordered[-1]["server_cpu_us"]
    out["errors"] = sum(r["errors"] for r in measured)
    return out


if __name__ == "__main__":
    main()
