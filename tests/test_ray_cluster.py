"""servekit on a real multi-host Ray cluster: three hosts (network, PID and mount
namespaces on a private bridge, ``servekit.bench.hosts``), a Ray head on host 1 and
workers on hosts 2 and 3 joined by address with ``ray start``, and ``servekit serve
--runtime ray --address`` on host 1, as a user runs it. Clients run on this machine (the
bridge's gateway) and send to the hosts' proxies.

Without root or ``ip``/``unshare``/``nsenter`` the module skips, naming why.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("ray", reason="needs the ray extra")

from conftest import wait_until
from servekit.bench.hosts import Host, Hosts, unavailable
from servekit.bench.raycluster import Clients, RayCluster, ServekitOn
from servekit.client import Client
from servekit.errors import ModelNotReady, ServerUnreachable
from servekit.zoo.tiny import build_simulated

why = unavailable()
pytestmark = [
    pytest.mark.skipif(why is not None, reason=why or ""),
    pytest.mark.timeout(400),
]

ADD_SUB = """
runtime = "ray"
[ray]
model_cpus = 0.25
stage_cpus = 0.1
ingress_replicas = 3
[[models]]
source = "{source}"
name = "add_sub"
instances = 3
"""

RAMP = """
runtime = "ray"
[ray]
model_cpus = 0.1
model_gpus = 1
stage_cpus = 0.1
ingress_replicas = 3
autoscaling = {{ min_replicas = 1, max_replicas = 3, upscale_delay_s = 1, downscale_delay_s = 5, look_back_period_s = 5 }}
[[models]]
source = "{source}"
name = "device"
[models.batching]
max_batch_size = 16
max_queue_delay_us = 2000
[models.autoscale]
window_s = 4
"""
"""A device-bound model (a simulated device: each batch 20 ms + 2.5 ms a row, one device
per host, which Ray sees as the host's one GPU) scaled by servekit's signal."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with Hosts(3) as hosts, RayCluster(hosts, gpus_per_host=1) as ray_cluster:
        yield ray_cluster


@pytest.fixture
def served(cluster: RayCluster, add_sub_path: Path, tmp_path: Path) -> Iterator[ServekitOn]:
    config = tmp_path / "serve.toml"
    config.write_text(ADD_SUB.format(source=add_sub_path))
    s = ServekitOn(cluster, cluster.head, config, tmp_path / "serve.log")
    try:
        for host in cluster.hosts.hosts:
            s.wait_ready(host, "add_sub")
        yield s
    finally:
        s.stop()


def add_sub_clients(served: ServekitOn, hosts: list[Host]) -> Clients:
    """Eight closed-loop clients of add_sub over ``hosts``' proxies, each checking its answers."""

    def inputs(k: int) -> dict[str, np.ndarray]:
        x = np.full((1, 16), k, np.float32)
        return {"INPUT0": x, "INPUT1": x}

    def right(k: int, out: dict[str, np.ndarray]) -> bool:
        return bool(np.array_equal(out["OUTPUT0"], np.full((1, 16), 2 * k, np.float32)))

    return Clients([served.url(h) for h in hosts], "add_sub", inputs, right)


def addresses(hosts: list[Host]) -> set[str]:
    return {h.address for h in hosts}


def test_every_host_has_a_proxy_and_the_replicas_spread_over_the_hosts(served, cluster):
    hosts = cluster.hosts.hosts
    with add_sub_clients(served, hosts) as load:
        load.wait_calls(300)
    assert load.failed() == []
    assert {w["address"] for w in cluster.where("add_sub")} == addresses(hosts)
    assert cluster.replicas() == {"add_sub": 3, "Ingress": 3}


@pytest.mark.parametrize("how", ["link cut", "raylet killed", "ray stop"])
def test_a_host_lost_under_load_costs_no_request(served, cluster, how):
    h1, h2, h3 = cluster.hosts.hosts
    with add_sub_clients(served, [h1, h2]) as load:
        load.wait_calls(100)
        lost = time.monotonic()
        if how == "link cut":
            h3.cut()
        elif how == "raylet killed":
            cluster.kill_raylet(h3)
        else:
            cluster.leave(h3)
        assert set(cluster.wait_nodes(2).values()) == addresses([h1, h2])
        # Ray restarts the lost model replica on the hosts left; the third ingress
        # replica (one per host) waits for a host.
        wait_until(lambda: cluster.replicas() == {"add_sub": 3, "Ingress": 2},
                   "add_sub back to 3 replicas", 120)  # fmt: skip
        load.wait_calls(100)
    assert load.failed() == []
    worst = max(answered - sent for sent, answered, _ in load.calls if answered > lost)
    print(f"{how}: {len(load.calls)} requests, none failed, worst latency {worst:.2f} s")
    assert {w["address"] for w in cluster.where("add_sub")} == addresses([h1, h2])

    if how == "link cut":
        h3.mend()
    cluster.rejoin(h3)
    assert len(cluster.wait_nodes(3)) == 3
    wait_until(lambda: cluster.replicas() == {"add_sub": 3, "Ingress": 3},
               "the third ingress replica back on host 3", 120)  # fmt: skip
    served.wait_ready(h3, "add_sub")
    with Client(served.url(h3)) as c:
        x = np.ones((1, 16), np.float32)
        assert np.array_equal(c.infer("add_sub", {"INPUT0": x, "INPUT1": x})["OUTPUT1"], 0 * x)


def test_sigterm_to_servekit_drains_the_cluster_and_exits_0(served, cluster):
    h1, h2, _ = cluster.hosts.hosts
    with add_sub_clients(served, [h1, h2]) as load:
        load.wait_calls(100)
        signalled = time.monotonic()
        code = served.stop()
    assert code == 0
    assert [o for sent, _, o in load.calls if sent < signalled and o is not True] == []
    after = load.failed(since=signalled)
    assert all(isinstance(o, ModelNotReady | ServerUnreachable) for o in after), after


def test_servekit_signal_scales_replicas_out_over_hosts_and_back(cluster, tmp_path):
    model = tmp_path / "device.onnx"
    onnx.save(build_simulated("device", 20_000, 2_500), model)
    config = tmp_path / "serve.toml"
    config.write_text(RAMP.format(source=model))
    served = ServekitOn(cluster, cluster.head, config, tmp_path / "serve.log")
    hosts = cluster.hosts.hosts
    rows = {"INPUT0": np.zeros((4, 16), np.float32)}
    try:
        for host in hosts:
            served.wait_ready(host, "device")
        urls = [served.url(h) for h in hosts[:2]]
        with Clients(urls, "device", lambda k: rows, rate=10) as load:
            time.sleep(8)
            assert cluster.replicas()["device"] == 1  # one device keeps up with 40 rows/s
            load.rate = 150  # 600 rows/s: more than one device's 270
            ramp = time.monotonic()
            wait_until(lambda: cluster.replicas()["device"] == 3, "3 device replicas", 120)
            scaled = time.monotonic() - ramp
            assert {w["address"] for w in cluster.where("device")} == addresses(hosts)
            load.rate = 10
            wait_until(lambda: cluster.replicas()["device"] == 1, "back to 1 replica", 150)
    finally:
        served.stop()
    print(f"1 -> 3 replicas {scaled:.1f} s after the load rose")
    assert load.failed() == []
