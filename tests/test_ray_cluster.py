"""servekit on a real multi-host Ray cluster: three hosts (network, PID and mount
namespaces on a private bridge, ``servekit.bench.hosts``), a Ray head on host 1 and
workers on hosts 2 and 3 joined by address with ``ray start``, and ``servekit serve
--runtime ray --address`` on host 1, as a user runs it. Clients run on this machine (the
bridge's gateway) and send to the hosts' proxies.

Without root or ``ip``/``unshare``/``nsenter`` the module skips, naming why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("ray", reason="needs the ray extra")

from conftest import sample, scrape, wait_until
from servekit.bench.hosts import Host, Hosts, unavailable
from servekit.bench.raycluster import (
    _DRIVER_INIT,
    ADD_SUB,
    RAMP,
    Clients,
    RayCluster,
    ServekitOn,
    add_sub_clients,
)
from servekit.client import Client
from servekit.errors import ModelNotReady, ServerUnreachable
from servekit.zoo.tiny import build_simulated

why = unavailable()
pytestmark = [
    pytest.mark.skipif(why is not None, reason=why or ""),
    pytest.mark.own_ray,
    pytest.mark.timeout(400),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    with Hosts(3) as hosts:
        cluster = RayCluster(hosts, gpus_per_host=1)
        try:
            yield cluster.start()
        finally:
            cluster.close()


@pytest.fixture
def served(cluster: RayCluster, add_sub_path: Path, tmp_path: Path) -> Iterator[ServekitOn]:
    """servekit serving add_sub on the cluster, stopped after the test (each test's own:
    one servekit app at a time, since stopping one stops Serve)."""
    config = tmp_path / "serve.toml"
    config.write_text(ADD_SUB.format(source=add_sub_path))
    s = ServekitOn(cluster, cluster.head, config, tmp_path / "serve.log")
    try:
        for host in cluster.hosts.hosts:
            s.wait_ready(host, "add_sub")
        yield s
    finally:
        s.stop()


def addresses(hosts: list[Host]) -> set[str]:
    return {h.address for h in hosts}


def answering_on(cluster: RayCluster, deployment: str, hosts: list[Host]) -> None:
    """Wait until ``deployment``'s replicas answer from exactly ``hosts``. Serve may count
    a replica RUNNING before a handle made just then routes to it (its router learns the
    replica set from the controller), so ``where`` is asked again, for up to 30 s."""
    answered: list[set[str]] = []

    def there() -> bool:
        answered.append({str(w["address"]) for w in cluster.where(deployment)})
        return answered[-1] == addresses(hosts)

    try:
        wait_until(there, f"{deployment} answering from {sorted(addresses(hosts))}", 30)
    except AssertionError as e:
        raise AssertionError(f"{e}; hosts that answered, call by call: {answered}") from None


def test_the_drivers_replies_keep_their_own_channel(tmp_path):
    """Ray's threads in a driver print a node's death to stdout, also with log_to_driver
    off: once that landed inside a reply's line, the reply was lost and the host-lost test
    failed. Whatever else the driver prints goes to stderr; its stdout holds replies only."""
    noise = (
        "import threading\n"
        "def talk():\n"
        "    for _ in range(2000):\n"
        "        print('(raylet) Raylet is terminated.', flush=True)\n"
        "        os.write(1, b'[state-dump] from C++\\n')\n"
        "threading.Thread(target=talk).start()\n"
        "for i in range(300):\n"
        "    out({'call': i})\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER_INIT + noise], capture_output=True, timeout=60, check=True
    )
    lines = done.stdout.decode().splitlines()
    assert lines == [f'servekit-out {{"call": {i}}}' for i in range(300)], lines[:5]
    assert done.stderr.count(b"Raylet is terminated") == 2000


def test_every_host_serves_the_replicas_spread_and_sigterm_drains_them(served, cluster):
    hosts = cluster.hosts.hosts
    with add_sub_clients(served, hosts) as load:
        load.wait_calls(300)
        # An ingress on each host (at most one a host, so three means all three); Ray
        # spreads the model's replicas as best it can (the device test's one GPU a host
        # forces one on each): here at least two hosts run them.
        assert cluster.replicas() == {"add_sub": 3, "Ingress": 3}
        assert len({w["address"] for w in cluster.where("add_sub")}) >= 2
        signalled = time.monotonic()  # SIGTERM with 8 clients on all three hosts' proxies
        code = served.stop()
    assert code == 0
    # The stop returned once Serve was gone: a Serve started next takes over none of it.
    assert cluster.serve_actors() == []
    assert [o for sent, _, o in load.calls if sent < signalled and o is not True] == []
    after = load.failed(since=signalled)
    assert all(isinstance(o, ModelNotReady | ServerUnreachable) for o in after), after


@pytest.mark.parametrize("how", ["link cut", "raylet killed", "ray stop"])
def test_a_host_lost_under_load_costs_no_request(served, cluster, how):
    h1, h2, h3 = cluster.hosts.hosts
    try:
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
        for host in (h1, h2):  # each host's ingress is idle again once the clients stop
            m = scrape(f"{served.url(host)}/metrics")
            pending = sample(m, "nv_inference_pending_request_count", model="add_sub", version="1")
            assert pending == 0
        worst = max(answered - sent for sent, answered, _ in load.calls if answered > lost)
        print(f"{how}: {len(load.calls)} requests, none failed, worst latency {worst:.2f} s")
        answering_on(cluster, "add_sub", [h1, h2])
    finally:  # host 3 back also when this failed: the module's later tests need all three
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
        with Clients(urls, "device", lambda k: rows, rate=5) as load:
            time.sleep(5)
            assert cluster.replicas()["device"] == 1  # one device keeps up with 20 rows/s
            load.rate = 150  # 600 rows/s: more than one device's 267
            ramp = time.monotonic()
            wait_until(lambda: cluster.replicas()["device"] == 3, "3 device replicas", 120)
            scaled = time.monotonic() - ramp
            answering_on(cluster, "device", hosts)  # one GPU a replica, one a host
            load.rate = 5
            fell = time.monotonic()
            seen: list[tuple[float, int]] = []  # (s after the fall, replicas): said if it fails

            def one() -> bool:
                seen.append((round(time.monotonic() - fell, 1), cluster.replicas()["device"]))
                return seen[-1][1] == 1

            try:
                wait_until(one, "back to 1 replica", 200)
            except AssertionError as e:
                raise AssertionError(f"{e}; replicas seen: {seen[::5]}") from None
            back = time.monotonic() - fell
    finally:
        served.stop()
    print(f"1 -> 3 replicas {scaled:.1f} s after the load rose, 3 -> 1 {back:.1f} s after it fell")
    assert load.failed() == []


def test_servekit_batch_runs_on_the_cluster_by_address(cluster, tmp_path, tiny_cnn_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from servekit.stages import synthetic_image

    images = tmp_path / "images"
    images.mkdir()
    for i in range(48):
        (images / f"img{i:02d}.jpg").write_bytes(synthetic_image(i, size=(64, 64)))
    # Which actor scores a block is Ray Data's choice (a short job's blocks can all go to
    # one): the job runs again, into a new folder, until two hosts have scored rows.
    hosts: set[str] = set()
    for attempt in range(3):
        out = tmp_path / f"out{attempt}"
        said = cluster.head.run(
            [sys.executable, "-m", "servekit", "batch", str(images), str(out),
             "--model", str(tiny_cnn_path), "--actors", "3", "--actor-cpus", "0.5",
             "--batch-size", "4", "--address", cluster.address],
            timeout_s=240, env=cluster.env_on(cluster.head),
        )  # fmt: skip
        assert "48 predictions for 48 files (0 failed)" in said
        rows = pq.read_table(out).to_pylist()
        assert sorted(r["path"] for r in rows) == sorted(str(p) for p in images.iterdir())
        hosts = {r["node"] for r in rows}
        if len(hosts) >= 2:
            break
    assert len(hosts) >= 2, f"every row came from one node: {hosts}"


def _call(url: str, method: str, path: str, body: object = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + path, None if body is None else json.dumps(body).encode(), method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


ONE = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "data": [1.0] * 16}
                  for n in ("INPUT0", "INPUT1")]}  # fmt: skip


def answering(url: str, n: int = 12) -> set[str]:
    """The versions that answer ``n`` requests through ``url``'s proxy."""
    versions = set()
    for _ in range(n):
        status, answer = _call(url, "POST", "/v2/models/add_sub/infer", ONE)
        assert status == 200, answer
        versions.add(answer["model_version"])
    return versions


def test_a_split_set_through_one_host_is_every_host_s_and_fails_no_request(
    cluster, add_sub_path, tmp_path
):
    """Each host's ingress routes with its own Traffic; a split set through host 2's proxy
    reaches the other two through Ray's KV store (``servekit.ray.shared``)."""
    config = tmp_path / "serve.toml"
    config.write_text(
        ADD_SUB.format(source=add_sub_path)
        + f'[[models.versions]]\nversion = 2\nsource = "{add_sub_path}"\n'
        + "[models.traffic]\nsplit = { 1 = 100, 2 = 0 }\n"
    )
    served = ServekitOn(cluster, cluster.head, config, tmp_path / "serve.log")
    hosts = cluster.hosts.hosts
    urls = [served.url(h) for h in hosts]
    try:
        for host in hosts:
            served.wait_ready(host, "add_sub")
        assert cluster.replicas()["Ingress"] == 3
        with add_sub_clients(served, hosts) as load:
            load.wait_calls(100)
            assert all(answering(url) == {"1"} for url in urls)
            status, state = _call(urls[1], "POST", "/v2/models/add_sub/traffic",
                                  {"split": {"1": 0, "2": 100}})  # fmt: skip
            assert status == 200 and state["split"] == {"1": 0, "2": 100}, state
            wait_until(lambda: all(answering(url) == {"2"} for url in urls),
                       "version 2 answering through every host", 15)  # fmt: skip
            for url in urls:
                status, state = _call(url, "GET", "/v2/models/add_sub/traffic")
                assert state["split"] == {"1": 0, "2": 100}, (url, state)
            load.wait_calls(100)
    finally:
        served.stop()
    assert load.failed() == []


def test_a_store_answers_alike_through_every_proxy(cluster, add_sub_path, tmp_path):
    """A [store] lives in the one ingress replica: Serve runs a proxy on the head and on
    each host with a replica, and every one of them reaches that replica, so each sees one
    index, one budget and one load or unload."""
    import shutil

    root = tmp_path / "store"
    root.mkdir()
    for i in range(6):
        shutil.copyfile(add_sub_path, root / f"add_{i}.onnx")
    config = tmp_path / "serve.toml"
    config.write_text(
        f'runtime = "ray"\n[ray]\nmodel_cpus = 0.25\n[store]\nroot = "{root}"\nload = "on_demand"\n'
        # Four first requests load four models at once, one after another in the ingress:
        # on a busy two-core machine the last can take past the default 5 s wait.
        "wait_s = 60\n"
    )
    # The head's one CPU taken, as KubeRay's head often has none (num-cpus 0): the ingress
    # then runs on another host, and the head's proxy reaches it across the bridge.
    cluster.python(
        "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On\n"
        "@ray.remote(num_cpus=1)\nclass Filler:\n    def ready(self):\n        return True\n"
        f"head = [n['NodeID'] for n in ray.nodes() if n['Alive'] and "
        f"n['NodeManagerAddress'] == {cluster.head.address!r}][0]\n"
        "f = Filler.options(name='filler', namespace='test', lifetime='detached', "
        "scheduling_strategy=On(head, soft=False)).remote()\n"
        "out(ray.get(f.ready.remote()))"
    )
    served = ServekitOn(cluster, cluster.head, config, tmp_path / "serve.log")
    try:
        served.wait_ready(cluster.head, None)  # a stored model is ready once loaded

        def proxies() -> list[str]:
            """The head's, and the ingress's host's once its proxy starts."""
            urls = [served.url(cluster.head)]
            for host in cluster.hosts.hosts[1:]:
                with Client(served.url(host), timeout_s=2) as c:
                    if c.is_ready():
                        urls.append(served.url(host))
            return urls

        wait_until(lambda: len(proxies()) == 2, "a proxy on the ingress's host", 60)
        urls = proxies()

        def inputs(k: int) -> dict[str, np.ndarray]:
            x = np.full((1, 16), k, np.float32)
            return {"INPUT0": x, "INPUT1": x}

        def right(k: int, out: dict[str, np.ndarray]) -> bool:
            return bool(np.array_equal(out["OUTPUT0"], np.full((1, 16), 2 * k, np.float32)))

        loads = [Clients(urls, f"add_{i}", inputs, right, clients=2) for i in range(4)]
        for load in loads:
            load.__enter__()
        try:
            for load in loads:
                load.wait_calls(40)
        finally:
            for load in loads:
                load.__exit__()
        assert [o for load in loads for o in load.failed()] == []
        index = [
            {e["name"]: e["state"] for e in _call(u, "POST", "/v2/repository/index")[1]}
            for u in urls
        ]
        assert all(i == index[0] for i in index), index
        assert {f"add_{i}" for i in range(4)} <= {m for m, s in index[0].items() if s == "READY"}
        status, _ = _call(urls[-1], "POST", "/v2/repository/models/add_5/load")
        assert status == 200
        for url in urls:  # loaded through one proxy, ready through each
            with Client(url) as c:
                assert c.is_ready("add_5")
    finally:
        served.stop()
        cluster.python("ray.kill(ray.get_actor('filler', namespace='test')); out(True)")
