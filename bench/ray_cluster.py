"""servekit on a multi-host Ray cluster (hosts as namespaces, ``servekit.bench.hosts``):
throughput on 1, 2 and 3 hosts, a host lost under load, the head lost, and the time from
a load ramp to new replicas. Needs root. Each part writes its figures as JSON.

    python bench/ray_cluster.py hosts --out bench/results/ray_cluster_hosts.json
    python bench/ray_cluster.py loss --times 10 --out bench/results/ray_cluster_loss.json
    python bench/ray_cluster.py head --out bench/results/ray_cluster_head.json
    python bench/ray_cluster.py head-ft --out bench/results/ray_cluster_head_ft.json   # needs redis-server
    python bench/ray_cluster.py scale --times 3 --out bench/results/ray_cluster_scale.json

hosts: a device-bound model (a simulated device per host, Ray's one GPU there: each
batch 80 ms + 10 ms a row, at most 16 rows, so one device does at most 66 rows/s), one
replica per host and an ingress per host, 12 closed-loop clients per host sending 8 rows
each to that host's proxy; rows/s answered and each device's busy share over the window.
loss: add_sub on 3 hosts, 8 clients on hosts 1 and 2's proxies; host 3 cut off (link
down) or its raylet killed, then brought back, ``--times`` each: requests failed and the
worst latency. head: the same load through host 2's proxy, then the head's GCS killed
(no GCS fault tolerance): what each 5 s of the next 90 answered. head-ft: the same with
GCS fault tolerance (Debian's redis-server on this machine keeps the GCS's tables), the
whole head host killed and its Ray started again 5 s later, as KubeRay restarts a head.
scale: the ramp of tests/test_ray_cluster.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx

from servekit import zoo
from servekit.bench.hosts import Hosts
from servekit.bench.raycluster import (
    ADD_SUB,
    RAMP,
    Clients,
    RayCluster,
    ServekitOn,
    add_sub_clients,
)
from servekit.bench.report import machine
from servekit.endpoints import free_port
from servekit.zoo.tiny import build_simulated

FIXED_US, ROW_US, ROWS = 80_000, 10_000, 16

DEVICE = """
runtime = "ray"
[ray]
model_cpus = 0.1
model_gpus = 1
stage_cpus = 0.1
ingress_replicas = {hosts}
[[models]]
source = "{source}"
name = "device"
instances = {hosts}
[models.batching]
max_batch_size = {rows}
max_queue_delay_us = 5000
"""


@contextmanager
def served(
    hosts: int, config: str, model: str, folder: Path
) -> Iterator[tuple[RayCluster, ServekitOn]]:
    with Hosts(hosts) as made:
        cluster = RayCluster(made, gpus_per_host=1).start()
        path = folder / "serve.toml"
        path.write_text(config)
        s = ServekitOn(cluster, cluster.head, path, folder / "serve.log")
        try:
            for host in made.hosts:
                s.wait_ready(host, model)
            yield cluster, s
        finally:
            s.stop()


def busy(cluster: RayCluster) -> dict[str, tuple[float, float]]:
    """Each host's device: (executions, rows) so far."""
    return {
        str(w["address"]): (float(w["executions"]), float(w["inferences"]))  # type: ignore[arg-type]
        for w in cluster.where("device", calls=40)
    }


def part_hosts(folder: Path, window_s: float) -> list[dict]:
    model = folder / "device.onnx"
    onnx.save(build_simulated("device", FIXED_US, ROW_US), model)
    rows = {"INPUT0": np.zeros((8, 16), np.float32)}
    out = []
    for n in (1, 2, 3):
        config = DEVICE.format(hosts=n, source=model, rows=ROWS)
        with served(n, config, "device", folder) as (cluster, s):
            urls = [s.url(h) for h in cluster.hosts.hosts]
            with Clients(urls, "device", lambda k: rows, clients=12 * n) as load:
                time.sleep(10)
                before, start, done = busy(cluster), time.monotonic(), len(load.calls)
                time.sleep(window_s)
                after, end = busy(cluster), time.monotonic()
                answered = [c for c in load.calls[done:] if c[2] is True]
            shares = {
                host: ((after[host][0] - e) * FIXED_US + (after[host][1] - r) * ROW_US)
                / 1e6 / (end - start)
                for host, (e, r) in before.items() if host in after
            }  # fmt: skip
            point = {
                "hosts": n,
                "rows_per_s": len(answered) * 8 / (end - start),
                "device_busy_share": {h: round(v, 3) for h, v in sorted(shares.items())},
                "failed": len(load.failed()),
            }
            print(point, flush=True)
            out.append(point)
    return out


def part_loss(folder: Path, times: int) -> list[dict]:
    """Each run on a fresh deployment, so host 3 holds a model replica when it is lost
    (replicas do not move back to a host that rejoins)."""
    source = zoo.build("add_sub", folder)
    config = folder / "serve.toml"
    config.write_text(ADD_SUB.format(source=source))
    out = []
    with Hosts(3) as made:
        cluster = RayCluster(made, gpus_per_host=1).start()
        h1, h2, h3 = made.hosts
        for how in ("link cut", "raylet killed"):
            for i in range(times):
                s = ServekitOn(cluster, h1, config, folder / "serve.log")
                try:
                    for host in made.hosts:
                        s.wait_ready(host, "add_sub")
                    on_h3 = sum(1 for w in cluster.where("add_sub") if w["address"] == h3.address)
                    with add_sub_clients(s, [h1, h2]) as load:
                        load.wait_calls(200)
                        lost = time.monotonic()
                        (h3.cut if how == "link cut" else lambda: cluster.kill_raylet(h3))()
                        cluster.wait_nodes(2)
                        while cluster.replicas() != {"add_sub": 3, "Ingress": 2}:
                            time.sleep(0.5)
                        restored = time.monotonic() - lost
                        load.wait_calls(200)
                finally:
                    s.stop()
                worst = max(b - a for a, b, _ in load.calls if b > lost)
                point = {
                    "how": how, "run": i + 1, "model_replicas_on_lost_host": on_h3,
                    "requests": len(load.calls), "failed": len(load.failed()),
                    "worst_latency_s": round(worst, 3), "replicas_restored_s": round(restored, 1),
                }  # fmt: skip
                print(point, flush=True)
                out.append(point)
                if how == "link cut":
                    h3.mend()
                cluster.rejoin(h3)
                cluster.wait_nodes(3)
    return out


def part_head(folder: Path, fault_tolerant: bool) -> list[dict]:
    """The head lost under load through host 2's proxy. Without GCS fault tolerance its
    GCS is killed; with it (a Redis on this machine keeps the GCS's tables) the whole head
    host dies and its Ray is started again 5 s later, as KubeRay restarts a head pod."""
    source = zoo.build("add_sub", folder)
    config = folder / "serve.toml"
    config.write_text(ADD_SUB.format(source=source))
    out: list[dict] = []
    with Hosts(3) as made, contextlib.ExitStack() as stack:
        redis = None
        if fault_tolerant:
            port = free_port()
            # Bound to the hosts' bridge only, so protected mode (which refuses any client
            # not on loopback when there is no password) is off.
            server = subprocess.Popen(
                ["redis-server", "--bind", made.gateway, "--port", str(port), "--save", "",
                 "--appendonly", "no", "--protected-mode", "no"],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            stack.callback(server.wait, 10)
            stack.callback(server.kill)
            redis = f"{made.gateway}:{port}"
            time.sleep(1)
        cluster = RayCluster(made, gpus_per_host=1, gcs_redis=redis).start()
        h1, h2, _ = made.hosts
        s = ServekitOn(cluster, h1, config, folder / "serve.log")
        for host in made.hosts:
            s.wait_ready(host, "add_sub")
        with add_sub_clients(s, [h2]) as load:
            load.wait_calls(200)
            killed = time.monotonic()
            if fault_tolerant:
                cluster.kill_host(h1)
                time.sleep(5)
                cluster.start_head()
            else:
                h1.run(["pkill", "-KILL", "-f", "gcs_server"])
            time.sleep(90)
        for k in range(-1, 18):
            lo, hi = killed + 5 * k, killed + 5 * (k + 1)
            calls = [c for c in load.calls if lo <= c[0] < hi]
            point = {
                "from_s": 5 * k, "sent": len(calls),
                "answered": sum(1 for c in calls if c[2] is True),
                "errors": sorted({type(c[2]).__name__ for c in calls if c[2] is not True}),
            }  # fmt: skip
            print(point, flush=True)
            out.append(point)
        if fault_tolerant:
            out.append({"replicas_after": cluster.replicas(), "nodes_after": len(cluster.nodes())})
        out.append({"servekit_exit": s.stop()})
        print(out[-2:], flush=True)
    return out


def part_scale(folder: Path, times: int) -> list[dict]:
    model = folder / "device.onnx"
    onnx.save(build_simulated("device", 20_000, 2_500), model)
    rows = {"INPUT0": np.zeros((4, 16), np.float32)}
    out = []
    with served(3, RAMP.format(source=model), "device", folder) as (cluster, s):
        urls = [s.url(h) for h in cluster.hosts.hosts[:2]]
        for i in range(times):
            with Clients(urls, "device", lambda k: rows, rate=10) as load:
                while cluster.replicas()["device"] != 1:
                    time.sleep(1)
                time.sleep(5)
                load.rate, ramp, seen = 150, time.monotonic(), {}
                while len(seen) < 2 or cluster.replicas()["device"] != 3:
                    n = cluster.replicas()["device"]
                    seen.setdefault(n, time.monotonic() - ramp)
                    time.sleep(0.5)
                seen[3] = time.monotonic() - ramp
                load.rate, calm = 10, time.monotonic()
                while cluster.replicas()["device"] != 1:
                    time.sleep(0.5)
                down = time.monotonic() - calm
            point = {
                "run": i + 1, "to_2_replicas_s": round(seen.get(2, seen[3]), 1),
                "to_3_replicas_s": round(seen[3], 1), "back_to_1_s": round(down, 1),
                "failed": len(load.failed()),
            }  # fmt: skip
            print(point, flush=True)
            out.append(point)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["hosts", "loss", "head", "head-ft", "scale"])
    p.add_argument("--times", type=int, default=10)
    p.add_argument("--window-s", type=float, default=30.0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if a.part == "hosts":
            points = part_hosts(folder, a.window_s)
        elif a.part == "loss":
            points = part_loss(folder, a.times)
        elif a.part in ("head", "head-ft"):
            points = part_head(folder, fault_tolerant=a.part == "head-ft")
        else:
            points = part_scale(folder, a.times)
    if a.out:
        a.out.write_text(
            json.dumps({"machine": machine(), "part": a.part, "points": points}, indent=1)
        )


if __name__ == "__main__":
    main()
