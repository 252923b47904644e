"""A real Ray cluster on ``Hosts``: a head on the first host and a worker on each other
one, joined by address with ``ray start``, the commands a user types on each machine.

Every Ray command and driver gets the cluster's token (Ray's token authentication, on by
default since 2.52, in ``RAY_AUTH_TOKEN``) and its own ``--temp-dir`` per host, as on
separate machines. Used by ``tests/test_ray_cluster.py`` and ``bench/ray_cluster.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from .hosts import Host, Hosts

__all__ = ["RayCluster"]

PORT = 6379


class RayCluster:
    """``ray start --head`` on ``hosts[0]``, ``ray start --address`` on the others."""

    def __init__(self, hosts: Hosts, cpus_per_host: int = 1, gpus_per_host: int = 0) -> None:
        self.hosts = hosts
        self.cpus_per_host, self.gpus_per_host = cpus_per_host, gpus_per_host
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

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        """What a driver or worker joins: the head's GCS."""
        return f"{self.head.address}:{PORT}"

    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def env_on(self, host: Host) -> dict[str, str]:
        """The environment of Ray on ``host``: the cluster's, and a ``TMPDIR`` of the host's
        own, so a simulated device (a lock file there, ``SimulatedDevice``) is one per host."""
        tmp = host.temp_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        return {**self.env, "TMPDIR": str(tmp)}

    def _start(self, host: Host, *how: str) -> None:
        host.run(
            [self.ray, "start", *how, f"--node-ip-address={host.address}",
             f"--num-cpus={self.cpus_per_host}", f"--num-gpus={self.gpus_per_host}",
             f"--temp-dir={host.temp_dir}"],
            env=self.env_on(host),
        )  # fmt: skip

    def start(self) -> None:
        self._start(self.head, "--head", f"--port={PORT}", "--include-dashboard=false")
        for host in self.hosts.hosts[1:]:
            self.join(host)

    def join(self, host: Host) -> None:
        """Start a Ray worker on ``host`` that joins the head (again, after ``leave``)."""
        self._start(host, f"--address={self.address}")

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
        """Run ``code`` as a Ray driver on ``host`` (the head) and return what it prints as
        JSON: ``ray`` is connected, ``out(value)`` prints."""
        script = (
            "import json, ray\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "def out(value):\n    print('servekit-out', json.dumps(value), flush=True)\n" + code
        )
        text = (host or self.head).run(
            [sys.executable, "-c", script], timeout_s=timeout_s, env=self.env_on(host or self.head)
        )
        said = [line for line in text.splitlines() if line.startswith("servekit-out ")]
        if not said:
            raise RuntimeError(f"the driver printed no out(...): {text[-2000:]}")
        return json.loads(said[-1].removeprefix("servekit-out "))

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

    def close(self) -> None:
        """Nothing to do beyond ``Hosts.close``, which ends every process on every host."""
