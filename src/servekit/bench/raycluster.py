"""A real Ray cluster on ``Hosts``: a head on the first host and a worker on each other
one, joined by address with ``ray start``, the commands a user types on each machine.

Every Ray command and driver gets the cluster's token (Ray's token authentication, on by
default since 2.52, in ``RAY_AUTH_TOKEN``) and its own ``--temp-dir`` per host, as on
separate machines. Used by ``tests/test_ray_cluster.py`` and ``bench/ray_cluster.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .hosts import Host, Hosts

__all__ = ["ADD_SUB", "RAMP", "Call", "Clients", "RayCluster", "ServekitOn", "add_sub_clients"]

PORT = 6379


class RayCluster:
    """``ray start --head`` on ``hosts[0]``, ``ray start --address`` on the others."""

    def __init__(
        self,
        hosts: Hosts,
        cpus_per_host: int = 1,
        gpus_per_host: int = 0,
        gcs_redis: str | None = None,
    ) -> None:
        self.hosts = hosts
        self.cpus_per_host, self.gpus_per_host = cpus_per_host, gpus_per_host
        self.gcs_redis = gcs_redis
        """``host:port`` of a Redis that keeps the GCS's tables (GCS fault tolerance, as
        KubeRay's ``gcsFaultToleranceOptions``): a restarted head takes the cluster back."""
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
            # The GCS declares a host dead after 3 missed checks 1 s apart (Ray's defaults
            # take about 15 s), so a host's loss is seen, and recovered from, sooner.
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
        }
        self._driver: _Driver | None = None
        self._driver_lock = threading.Lock()

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        """What a driver or worker joins: the head's GCS."""
        return f"{self.head.address}:{PORT}"

    def env_on(self, host: Host) -> dict[str, str]:
        """The environment of Ray on ``host``: the cluster's, and a ``TMPDIR`` of the host's
        own, so a simulated device (a lock file there, ``SimulatedDevice``) is one per host."""
        tmp = host.temp_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        return {**self.env, "TMPDIR": str(tmp)}

    def start(self) -> RayCluster:
        """The head, then each worker; the cluster ends with its ``Hosts`` (``close``)."""
        self.start_head()
        for host in self.hosts.hosts[1:]:
            self.join(host)
        return self

    def start_head(self) -> None:
        """``ray start --head`` on host 1 (again, after ``kill_host``: a restarted head pod)."""
        env = self.env_on(self.head)
        if self.gcs_redis is not None:
            env |= {"RAY_REDIS_ADDRESS": self.gcs_redis}
        self.head.run(
            [self.ray, "start", "--head", f"--port={PORT}", "--include-dashboard=false",
             f"--node-ip-address={self.head.address}", f"--num-cpus={self.cpus_per_host}",
             f"--num-gpus={self.gpus_per_host}", f"--temp-dir={self.head.temp_dir}"],
            env=env,
        )  # fmt: skip

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process on ``host`` but its init: a machine (or pod) that died."""
        host.kill_all()

    def join(self, host: Host) -> None:
        """Start a Ray worker on ``host`` that joins the head (again, after ``leave``)."""
        host.run(
            [self.ray, "start", f"--address={self.address}", f"--node-ip-address={host.address}",
             f"--num-cpus={self.cpus_per_host}", f"--num-gpus={self.gpus_per_host}",
             f"--temp-dir={host.temp_dir}"],
            env=self.env_on(host),
        )  # fmt: skip

    def leave(self, host: Host) -> None:
        """``ray stop`` on ``host``: its Ray stops as a user stops it (the others run on)."""
        host.run([self.ray, "stop"], env=self.env)

    def kill_raylet(self, host: Host) -> None:
        """SIGKILL ``host``'s raylet (its workers and replicas die with it)."""
        host.run(["pkill", "-KILL", "-f", "ray/raylet/raylet"])

    def popen(self, host: Host, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """``argv`` on ``host`` with the cluster's token (a driver: ``servekit serve``)."""
        return host.popen(argv, env=self.env_on(host), **kwargs)

    def python(self, code: str, host: Host | None = None, timeout_s: float = 120) -> object:
        """Run ``code`` in a Ray driver on ``host`` and return what it last gave ``out`` (as
        JSON): ``ray`` is connected, ``out(value)`` prints. On the head (None) one driver
        runs every call, started at the first and again after it dies (a head killed):
        a driver started for each call costs seconds of a busy host's CPU, and tests poll."""
        if host is not None and host is not self.head:
            script = f"{_DRIVER_INIT}\nray.init(address={self.address!r}, log_to_driver=False)\n"
            text = host.run(
                [sys.executable, "-c", script + code], timeout_s=timeout_s, env=self.env_on(host)
            )
            return _last_out(text.splitlines(), text[-2000:])
        with self._driver_lock:
            if self._driver is None or self._driver.proc.poll() is not None:
                self._driver = _Driver(self, self.head)
            try:
                return self._driver.call(code, timeout_s)
            except _CodeFailed:
                raise
            except (RuntimeError, TimeoutError):  # the driver died or hangs: a new one next
                self._driver.close()
                self._driver = None
                raise

    def close(self) -> None:
        """Stop the head's driver (the hosts' own ends stop the rest)."""
        with self._driver_lock:
            if self._driver is not None:
                self._driver.close()
                self._driver = None

    def nodes(self) -> dict[str, str]:
        """Each live node's id and address, from the GCS."""
        found = self.python(
            "out({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']})"
        )
        assert isinstance(found, dict)
        return found

    def wait_nodes(self, count: int, timeout_s: float = 120) -> dict[str, str]:
        """Wait until ``count`` nodes are alive (a lost node is declared dead, a returning
        one joins); returns them."""
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = self.nodes()
            if len(nodes) == count or time.monotonic() > deadline:
                return nodes
            time.sleep(1.0)

    def rejoin(self, host: Host) -> None:
        """``host``'s Ray started again, as its user would after the host came back
        (whatever is left of it stopped first)."""
        with contextlib.suppress(RuntimeError):  # nothing left to stop
            self.leave(host)
        self.join(host)

    def replicas(self, app: str = "servekit") -> dict[str, int]:
        """Each deployment of ``app`` and its RUNNING replica count (Serve's controller)."""
        found = self.python(
            "from ray import serve\n"
            f"app = serve.status().applications[{app!r}]\n"
            "out({n: d.replica_states.get('RUNNING', 0) for n, d in app.deployments.items()})"
        )
        assert isinstance(found, dict)
        return found

    def serve_actors(self) -> list[str]:
        """The names of Serve's own actors (controller, proxies, replicas) alive now."""
        found = self.python(
            "from servekit.ray.runtime import serve_actors\nout(sorted(serve_actors()))"
        )
        assert isinstance(found, list)
        return found

    def where(self, deployment: str, calls: int = 60) -> list[dict[str, object]]:
        """What ``calls`` calls of ``deployment``'s ``where()`` found, one entry a replica
        (servekit's model replicas answer it): each with its host's ``address``."""
        seen = self.python(
            "from ray import serve\n"
            f"h = serve.get_deployment_handle({deployment!r}, 'servekit')\n"
            f"out([h.where.remote().result() for _ in range({calls})])"
        )
        assert isinstance(seen, list)
        nodes = self.nodes()
        replicas = {w["replica"]: {**w, "address": nodes.get(w["node"], "?")} for w in seen}
        return list(replicas.values())


_DRIVER_INIT = """import json, os, sys
# The replies' own channel: Ray's threads print a node's death to stdout (with
# log_to_driver off too), in the middle of a reply's line. Everything else goes to stderr.
channel = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
import ray
def say(*words):
    channel.write(" ".join(words) + "\\n")
    channel.flush()
def out(value):
    say("servekit-out", json.dumps(value))
"""

_DRIVER_LOOP = """
ray.init(address=sys.argv[1], log_to_driver=False)
from ray.serve import context
say("servekit-ready")
for line in sys.stdin:
    context._disconnect()  # Serve's controller may be another since the last call
    try:
        exec(json.loads(line), {"ray": ray, "out": out})
    except Exception as exc:
        say("servekit-error", json.dumps(f"{type(exc).__name__}: {exc}"))
    say("servekit-done")
"""


def _last_out(lines: list[str], context: object) -> object:
    """The value a driver last gave ``out`` among the ``lines`` it printed."""
    outs = [line for line in lines if line.startswith("servekit-out ")]
    if not outs:
        raise RuntimeError(f"the driver printed no out(...): {context}")
    return json.loads(outs[-1].removeprefix("servekit-out "))


class _CodeFailed(RuntimeError):
    """The code sent to a driver raised (the driver itself goes on)."""


class _Driver:
    """One Python process connected to the cluster as a driver, running each call's code
    as it is sent (one JSON line on its stdin; what it said, read from its stdout)."""

    def __init__(self, cluster: RayCluster, host: Host) -> None:
        self.host = host
        self.log = (host.temp_dir / "driver.log").open("ab")
        self.proc = cluster.popen(
            host, [sys.executable, "-c", _DRIVER_INIT + _DRIVER_LOOP, cluster.address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        )  # fmt: skip
        self.lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="ray-driver", daemon=True)
        self._reader.start()
        try:
            self._until("servekit-ready", 120)
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for raw in self.proc.stdout:
                self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def _until(self, end: str, timeout_s: float) -> list[str]:
        deadline, said = time.monotonic() + timeout_s, list[str]()
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the driver said nothing more in {timeout_s:g} s") from None
            if line is None:
                raise RuntimeError(f"the driver exited {self.proc.wait()}: {said[-5:]}")
            if line == end:
                return said
            said.append(line)

    def call(self, code: str, timeout_s: float) -> object:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(code).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise RuntimeError(f"the driver is gone: {exc}") from None
        said = self._until("servekit-done", timeout_s)
        errors = [line for line in said if line.startswith("servekit-error ")]
        if errors:
            raise _CodeFailed(json.loads(errors[-1].removeprefix("servekit-error ")))
        return _last_out(said, said[-5:])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError, RuntimeError):
                self.host.signal(self.proc, signal.SIGKILL)
            self.proc.wait(10)
        self._reader.join(10)
        self.log.close()


class ServekitOn:
    """``servekit serve --config CONFIG --address`` on ``host`` against ``cluster`` (the
    user's command); ``stop`` sends it SIGTERM and returns its exit code."""

    def __init__(
        self, cluster: RayCluster, host: Host, config: Path, log: Path, port: int = 8000
    ) -> None:
        self.cluster, self.host, self.log, self.port = cluster, host, log, port
        with log.open("wb") as out:
            self.proc = cluster.popen(
                host,
                [sys.executable, "-m", "servekit", "serve", "--config", str(config),
                 "--address", cluster.address],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def url(self, host: Host) -> str:
        """The proxy on ``host``."""
        return f"http://{host.address}:{self.port}"

    def wait_ready(self, host: Host, model: str | None, timeout_s: float = 180) -> None:
        """Wait until ``host``'s proxy says ``model`` (None: the server) is ready (raises,
        with the log's tail, if servekit exits first or time runs out)."""
        from ..client import Client
        from ..errors import ModelNotReady

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"servekit exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(ModelNotReady), Client(self.url(host), timeout_s=5) as c:
                if c.is_ready(model):
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{model} not ready on {host.address} in {timeout_s:g} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.host.signal(self.proc, signal.SIGTERM)
        try:
            return self.proc.wait(150)  # a drain, then Serve's shutdown, then its actors gone
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


Call = tuple[float, float, object]
"""One call: when it was sent, when it came back, and True (a right answer) or what came
back instead."""


class Clients:
    """Clients of one model over several proxies, keeping every ``Call``. Closed loop
    (``rate`` None: each client sends again as soon as it is answered) or open loop
    (Poisson arrivals at ``rate`` requests/s in all, changeable while it runs)."""

    def __init__(
        self,
        urls: list[str],
        model: str,
        inputs: Callable[[int], dict[str, np.ndarray]],
        check: Callable[[int, dict[str, np.ndarray]], bool] = lambda k, out: True,
        clients: int = 8,
        rate: float | None = None,
    ) -> None:
        self.model, self.inputs, self.check, self.rate = model, inputs, check, rate
        self.calls: list[Call] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(urls[k % len(urls)], k))
            for k in range(clients)
        ]

    def _loop(self, url: str, k: int) -> None:
        from ..client import Client

        rng = random.Random(k)
        x = self.inputs(k)
        due = time.monotonic() + rng.random()
        with Client(url, timeout_s=120) as c:
            while not self._stop.is_set():
                if self.rate is not None:
                    due += rng.expovariate(self.rate / len(self._threads))
                    time.sleep(max(0.0, due - time.monotonic()))
                sent = time.monotonic()
                try:
                    outcome: object = self.check(k, c.infer(self.model, x))
                except Exception as exc:
                    outcome = exc
                    time.sleep(0.05)
                self.calls.append((sent, time.monotonic(), outcome))

    def __enter__(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(150)

    def wait_calls(self, count: int, timeout_s: float = 60) -> None:
        """Wait until ``count`` more calls have come back."""
        target, deadline = len(self.calls) + count, time.monotonic() + timeout_s
        while len(self.calls) < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} more calls not back in {timeout_s:g} s")
            time.sleep(0.05)

    def failed(self, since: float = 0.0) -> list[object]:
        """What came back instead of a right answer, for calls sent after ``since``."""
        return [o for sent, _, o in self.calls if sent >= since and o is not True]


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
"""add_sub on three hosts: a replica and an ingress on each (``.format(source=path)``)."""

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
window_s = 8
"""
"""A device-bound model (``build_simulated("device", 20_000, 2_500)``: each batch 20 ms +
2.5 ms a row, one device per host, which Ray sees as the host's one GPU) scaled by
servekit's signal from 1 to 3 replicas. An 8 s window: at a low rate each replica's
queue term reads a handful of requests, one of which may have waited out a batch."""


def add_sub_clients(served: ServekitOn, hosts: list[Host]) -> Clients:
    """Eight closed-loop clients of add_sub over ``hosts``' proxies, each checking its answers."""

    def inputs(k: int) -> dict[str, np.ndarray]:
        x = np.full((1, 16), k, np.float32)
        return {"INPUT0": x, "INPUT1": x}

    def right(k: int, out: dict[str, np.ndarray]) -> bool:
        return bool(np.array_equal(out["OUTPUT0"], np.full((1, 16), 2 * k, np.float32)))

    return Clients([served.url(h) for h in hosts], "add_sub", inputs, right)
