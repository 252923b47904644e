"""servekit on a real multi-host Ray cluster: three hosts (network, PID and mount
namespaces on a private bridge, ``servekit.bench.hosts``), a Ray head on host 1 and
workers on hosts 2 and 3 joined by address with ``ray start``, and ``servekit serve
--runtime ray --address`` on host 1, as a user runs it. Clients run on this machine (the
bridge's gateway) and send to the hosts' proxies.

Without root or ``ip``/``unshare``/``nsenter`` the module skips, naming why.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("ray", reason="needs the ray extra")

from conftest import wait_until
from servekit.bench.hosts import Host, Hosts, unavailable
from servekit.bench.raycluster import RayCluster
from servekit.client import Client
from servekit.errors import ModelNotReady, ServerUnreachable
from servekit.zoo.tiny import build_simulated

why = unavailable()
pytestmark = [
    pytest.mark.skipif(why is not None, reason=why or ""),
    pytest.mark.timeout(400),
]

PORT = 8000
CONFIG = """
runtime = "ray"
[server]
http_port = {port}
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
[server]
http_port = {port}
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
per host, which Ray sees as its one GPU) scaled by servekit's signal from 1 to 3 replicas."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with Hosts(3) as hosts, RayCluster(hosts, gpus_per_host=1) as ray_cluster:
        yield ray_cluster


class Served:
    """``servekit serve`` on host 1 against the cluster; ``stop`` sends it SIGTERM."""

    def __init__(
        self, cluster: RayCluster, config: Path, log: Path, model: str = "add_sub"
    ) -> None:
        self.cluster, self.log, self.model = cluster, log, model
        with log.open("wb") as out:
            self.proc = cluster.popen(
                cluster.head,
                [sys.executable, "-m", "servekit", "serve", "--config", str(config),
                 "--address", cluster.address],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def url(self, host: Host) -> str:
        return f"http://{host.address}:{PORT}"

    def wait_ready(self, host: Host, timeout_s: float = 180) -> None:
        def ready() -> bool:
            with contextlib.suppress(ModelNotReady), Client(self.url(host), timeout_s=5) as c:
                return c.is_ready(self.model)
            return False

        def alive() -> bool:
            if self.proc.poll() is None:
                return True
            print(self.log.read_text()[-3000:])
            return False

        wait_until(ready, f"{self.model} ready on {host.address}", timeout_s, alive=alive)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.cluster.head.signal(self.proc, signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def served(cluster: RayCluster, add_sub_path: Path, tmp_path: Path) -> Iterator[Served]:
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG.format(port=PORT, source=add_sub_path))
    s = Served(cluster, config, tmp_path / "serve.log")
    try:
        for host in cluster.hosts.hosts:
            s.wait_ready(host)
        yield s
    finally:
        s.stop()


class Load:
    """Eight closed-loop clients spread over ``hosts``' proxies; every call kept as
    (sent, answered, outcome): True for a right answer, else what came back."""

    def __init__(self, served: Served, hosts: list[Host], clients: int = 8) -> None:
        self.calls: list[tuple[float, float, object]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(served.url(hosts[k % len(hosts)]), k))
            for k in range(clients)
        ]

    def _loop(self, url: str, k: int) -> None:
        x = np.full((1, 16), k, np.float32)
        with Client(url, timeout_s=120) as c:
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    out = c.infer("add_sub", {"INPUT0": x, "INPUT1": x})
                    outcome: object = bool(np.array_equal(out["OUTPUT0"], 2 * x))
                except Exception as exc:
                    outcome = exc
                    time.sleep(0.05)
                self.calls.append((sent, time.monotonic(), outcome))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        wait_until(lambda: len(self.calls) >= 100, "100 answers", 60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)

    def failed(self) -> list[object]:
        return [o for _, _, o in self.calls if o is not True]


def replicas(cluster: RayCluster) -> dict[str, int]:
    """Each deployment's RUNNING replica count, from Serve's controller."""
    found = cluster.python(
        "from ray import serve\n"
        "app = serve.status().applications['servekit']\n"
        "out({n: d.replica_states.get('RUNNING', 0) for n, d in app.deployments.items()})"
    )
    assert isinstance(found, dict)
    return found


def model_nodes(cluster: RayCluster, model: str = "add_sub") -> set[str]:
    """The addresses of the hosts whose ``model`` replicas answer ``where()``."""
    nodes = cluster.nodes()
    seen = cluster.python(
        "from ray import serve\n"
        f"h = serve.get_deployment_handle({model!r}, 'servekit')\n"
        "out(sorted({h.where.remote().result()['node'] for _ in range(60)}))"
    )
    assert isinstance(seen, list)
    return {nodes.get(node, node) for node in seen}


def rejoin(cluster: RayCluster, host: Host) -> None:
    """The host's Ray started again, as its user would after the host came back."""
    with contextlib.suppress(RuntimeError):  # nothing left to stop
        cluster.leave(host)
    cluster.join(host)
    assert len(cluster.wait_nodes(3)) == 3


def test_every_host_has_a_proxy_and_the_replicas_spread_over_the_hosts(served, cluster):
    hosts = cluster.hosts.hosts
    with Load(served, hosts) as load:
        load_before = len(load.calls)
        wait_until(lambda: len(load.calls) >= load_before + 300, "300 more answers", 60)
    assert load.failed() == []
    assert model_nodes(cluster) == {h.address for h in hosts}
    assert replicas(cluster) == {"add_sub": 3, "Ingress": 3}


@pytest.mark.parametrize("how", ["link cut", "raylet killed", "ray stop"])
def test_a_host_lost_under_load_costs_no_request(served, cluster, how):
    h1, h2, h3 = cluster.hosts.hosts
    with Load(served, [h1, h2]) as load:
        lost = time.monotonic()
        if how == "link cut":
            h3.cut()
        elif how == "raylet killed":
            cluster.kill_raylet(h3)
        else:
            cluster.leave(h3)
        assert set(cluster.wait_nodes(2).values()) == {h1.address, h2.address}
        # Ray restarts the lost model replica on the hosts left; the third ingress
        # replica (one per host) waits for a host.
        wait_until(lambda: replicas(cluster) == {"add_sub": 3, "Ingress": 2},
                   "add_sub back to 3 replicas", 120)  # fmt: skip
        after = len(load.calls)
        wait_until(lambda: len(load.calls) >= after + 100, "100 answers on two hosts", 60)
    assert load.failed() == []
    worst = max(answered - sent for sent, answered, _ in load.calls if answered > lost)
    print(f"{how}: {len(load.calls)} requests, none failed, worst latency {worst:.2f} s")
    assert model_nodes(cluster) == {h1.address, h2.address}

    if how == "link cut":
        h3.mend()
    rejoin(cluster, h3)
    wait_until(lambda: replicas(cluster) == {"add_sub": 3, "Ingress": 3},
               "the third ingress replica back on host 3", 120)  # fmt: skip
    served.wait_ready(h3)
    with Client(served.url(h3)) as c:
        x = np.ones((1, 16), np.float32)
        assert np.array_equal(c.infer("add_sub", {"INPUT0": x, "INPUT1": x})["OUTPUT1"], 0 * x)


def test_sigterm_to_servekit_drains_the_cluster_and_exits_0(served, cluster):
    h1, h2, _ = cluster.hosts.hosts
    with Load(served, [h1, h2]) as load:
        signalled = time.monotonic()
        code = served.stop()
    assert code == 0
    before = [o for sent, _, o in load.calls if sent < signalled]
    assert [o for o in before if o is not True] == []
    after = [o for sent, _, o in load.calls if sent >= signalled]
    assert all(o is True or isinstance(o, ModelNotReady | ServerUnreachable) for o in after)


class Paced:
    """Open-loop load: Poisson arrivals at ``rate`` requests/s in all (changeable), four
    rows each, from eight threads over ``hosts``' proxies; every call kept as in ``Load``."""

    def __init__(self, served: Served, hosts: list[Host], rate: float) -> None:
        self.rate = rate
        self.calls: list[tuple[float, float, object]] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(served, hosts[k % len(hosts)], k))
            for k in range(8)
        ]

    def _loop(self, served: Served, host: Host, k: int) -> None:
        rng = random.Random(k)
        x = np.full((4, 16), k, np.float32)
        with Client(served.url(host), timeout_s=120) as c:
            due = time.monotonic() + rng.random()
            while not self._stop.is_set():
                due += rng.expovariate(self.rate / len(self._threads))
                time.sleep(max(0.0, due - time.monotonic()))
                sent = time.monotonic()
                try:
                    c.infer(served.model, {"INPUT0": x})
                    outcome: object = True
                except Exception as exc:
                    outcome = exc
                self.calls.append((sent, time.monotonic(), outcome))

    def __enter__(self) -> Paced:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)


def test_servekit_signal_scales_replicas_out_over_hosts_and_back(cluster, tmp_path):
    model = tmp_path / "device.onnx"
    onnx.save(build_simulated("device", 20_000, 2_500), model)
    config = tmp_path / "serve.toml"
    config.write_text(RAMP.format(port=PORT, source=model))
    served = Served(cluster, config, tmp_path / "serve.log", model="device")
    h1, h2, h3 = cluster.hosts.hosts
    try:
        for host in (h1, h2, h3):
            served.wait_ready(host)
        with Paced(served, [h1, h2], rate=10) as load:
            time.sleep(8)
            assert replicas(cluster)["device"] == 1  # one device keeps up with 40 rows/s
            load.rate = 150  # 600 rows/s: more than one device's 270
            ramp = time.monotonic()
            wait_until(lambda: replicas(cluster)["device"] == 3, "3 device replicas", 120)
            scaled = time.monotonic() - ramp
            assert model_nodes(cluster, "device") == {h1.address, h2.address, h3.address}
            load.rate = 10
            wait_until(lambda: replicas(cluster)["device"] == 1, "back to 1 replica", 150)
    finally:
        served.stop()
    print(f"1 -> 3 replicas {scaled:.1f} s after the load rose")
    assert [o for _, _, o in load.calls if o is not True] == []
