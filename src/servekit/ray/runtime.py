"""``RayRuntime``: a ``ServeConfig`` served by Ray Serve on a Ray of its own, or on the
running cluster at ``[ray] address``.

``start`` starts (or joins) Ray, starts Serve on the config's host and HTTP port (a proxy
on every host) and deploys ``build_app(config)``, then logs the ports Ray picked itself
(with ``[ray] ports``, Ray starts on those: ``servekit.ray.head``); ``reload`` deploys again (Ray rolls the
replicas over, each re-reading the model file; a file that does not load fails on the
driver and the serving version stays); ``stop`` drains the ingress replicas
(``servekit.ray.drain``), then stops Serve, and Ray when it started it. Ray restarts dead
replicas itself, so there is never a ``problem``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import ServeConfig
from ..runtime.processes import descendants, end_processes, listening_ports
from . import drain
from .app import APP_NAME, build_app, ray_config
from .head import RayHead

__all__ = ["RayRuntime"]

log = logging.getLogger("servekit")


LOOK_S = 10.0
"""How often the supervisor's check looks for ports opened by replicas Ray started later."""


class RayRuntime:
    """The ``ray`` runtime: start, use, stop (or a context manager)."""

    def __init__(
        self, config: ServeConfig, *, address: str = "", num_cpus: int | None = None
    ) -> None:
        self.config = ray_config(config)
        self.address = address or self.config.ray.address or "local"
        self.num_cpus = num_cpus if self.address == "local" else None
        self._owns_ray = False
        self._before: set[int] | None = None
        """This process's descendants before ``ray.init``, while it runs (and after, if cut
        short): what Ray started is what is new."""
        self._imported = False
        """Whether Ray imported whole (a stop during ``import ray`` has nothing to stop)."""
        self._origins: dict[str, object] | None = None
        self._head: RayHead | None = None
        """The Ray servekit started on the ports it was given (``[ray] ports``), if any."""
        self._said: set[int] = set()
        """Ports Ray picked itself that a line has announced already (``ray_ports``)."""
        self._next_look = 0.0
        self.run_id = f"{APP_NAME}/{uuid.uuid4().hex}"
        """This run's keys in Ray's KV store: its drain flag (``servekit.ray.drain``: SIGTERM
        drains its replicas only) and its shared traffic (``servekit.ray.shared``)."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> RayRuntime:
        return cls(config)

    def start(self) -> RayRuntime:
        ports = self.config.ray.ports
        head = RayHead(ports, num_cpus=self.num_cpus) if ports else None
        if head is not None:
            head.authenticate()  # before Ray's import: the driver reads its mode then
        import ray
        from ray import serve

        self._imported = True
        app = build_app(self.config, run_id=self.run_id)  # fails before the cluster is touched
        self._origins = _origins(self.config)
        if not ray.is_initialized():
            self._owns_ray = True  # first: a stop while Ray starts still shuts down its part
            self._before = set(descendants())
            with _signal_handlers_kept():
                if head is not None:  # on the ports given: ray start, joined by address
                    self._head = head
                    ray.init(address=head.start())
                else:
                    ray.init(address=self.address, num_cpus=self.num_cpus, include_dashboard=False)
            self._before = None  # started whole: ray.shutdown knows all it started
        elif head is not None:
            raise ValueError(
                "[ray] ports: this process already runs a Ray, started before servekit's, "
                "whose ports are not servekit's to choose"
            )
        s = self.config.server
        if self.config.ray.direct:  # the ingress replicas listen themselves (ray.direct)
            serve.start(proxy_location="Disabled")
        else:
            serve.start(http_options={"host": s.host, "port": s.http_port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        if self._owns_ray:
            log.info("%s", self.ray_ports())
        return self

    def ray_ports(self) -> str:
        """What the Ray servekit started listens on that no line has said yet: the ports
        Ray picked itself, by process (all of them where none were given; with ``[ray]
        ports``, Ray Serve's replicas' inter-deployment gRPC, which Ray gives no setting).
        Said at start, after a redeploy and when a replica Ray starts later opens one."""
        said = {self.config.server.http_port, *self.config.ray.ports, *self._said}
        below = descendants()
        picked: dict[int, str] = {}
        for pid, ports in listening_ports([os.getpid(), *below]).items():
            argv = below.get(pid) or ["servekit"]
            who = argv[0] if argv[0].startswith("ray::") else Path(argv[0]).name
            picked.update({port: who for port in ports - said})
        self._said.update(picked)
        if not picked:
            return "Ray listens on no port beyond those given" if not self._said else ""
        where = ", ".join(f"{port} ({who})" for port, who in sorted(picked.items()))
        given = "beside those given, " if self.config.ray.ports else ""
        return f"Ray listens {given}on ports it picked: {where}"

    def problem(self) -> str | None:
        """None (Ray replaces its own replicas); every ``LOOK_S`` the ports a replica Ray
        started since (autoscaling, a replacement) opened are said."""
        if self._owns_ray and time.monotonic() >= self._next_look:
            self._next_look = time.monotonic() + LOOK_S
            line = self.ray_ports()
            if line:
                log.info("%s", line)
        return None

    def restart(self) -> None:
        self.reload()

    def reload(self) -> list[str]:
        """Deploy again, unless every model comes from object storage and no object
        changed (each is re-checked against its store; a replica fetches from the cache)."""
        from ray import serve

        origins = _origins(self.config)
        if origins is not None and origins == self._origins:
            return [f"{APP_NAME}: unchanged ({', '.join(origins)})"]
        serve.run(build_app(self.config, run_id=self.run_id), name=APP_NAME, route_prefix="/")
        self._origins = origins
        done = [f"{APP_NAME}: redeployed {[m.name for m in self.config.models]}"]
        ports = self.ray_ports() if self._owns_ray else ""  # new replicas, new ports
        return done + ([ports] if ports else [])

    def deployments(self) -> dict[str, Any]:
        """Each deployment's running replica count (what Ray has, read back)."""
        from ray import serve

        app = serve.status().applications[APP_NAME]
        return {
            name: sum(n for state, n in d.replica_states.items() if str(state) == "RUNNING")
            for name, d in app.deployments.items()
        }

    def drain(self) -> int:
        """Drain every ingress replica (``servekit.ray.drain``) within ``exit_timeout_s``;
        returns how many replicas were left with requests in flight."""
        try:
            replicas = self.deployments().get("Ingress", 0)
        except Exception:  # Serve is not running (it never started, or died)
            return 0
        drain.begin(self.run_id)
        timeout_s = max(self.config.server.exit_timeout_s, drain.SETTLE_S + 1.0)
        return replicas - drain.wait(self.run_id, replicas, timeout_s)

    def stop(self) -> None:
        """Drain, then stop Serve (and Ray, when this runtime started it). On a cluster that
        runs other Serve applications, only servekit's is deleted: they keep serving."""
        if not self._imported:
            return
        import ray
        from ray import serve

        if ray.is_initialized():
            left = self.drain()
            if left:
                log.warning("%d ingress replica(s) still had requests after %d s", left,
                            self.config.server.exit_timeout_s)  # fmt: skip
            _stop_serve(serve)
            with contextlib.suppress(Exception):  # the GCS is gone: nothing to forget
                drain.clear(self.run_id)
        if self._owns_ray:  # also when a signal cut ray.init short: what it started stops
            # Cut short, Ray may not know its own processes. They are found as this
            # process's descendants before the shutdown too: a raylet it ends leaves its
            # agents to init, out of reach of a later look.
            started = self._started_by_ray()
            ray.shutdown()
            if self._head is not None:  # ray start's, with every process of its Ray
                self._head.stop()
                self._head = None
            self._owns_ray = False
            started |= self._started_by_ray()
            if started:
                log.warning("stopping %d process(es) of a Ray start cut short", len(started))
                end_processes(started)
            self._before = None

    def _started_by_ray(self) -> set[int]:
        """Ray's processes below this one that a start cut short left (none otherwise)."""
        if self._before is None:
            return set()
        return {
            pid for pid, argv in descendants().items() if pid not in self._before and _is_ray(argv)
        }

    def __enter__(self) -> RayRuntime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_serve(serve: Any) -> None:
    """Serve shut down, unless applications other than servekit's run on it (a cluster's
    neighbours, a peer deployed for comparison): then servekit's app alone is deleted."""
    try:
        others = [name for name in serve.status().applications if name != APP_NAME]
    except Exception:  # Serve is not running (it never started, or died)
        others = []
    if others:
        log.info("deleting Serve application %r; %s keep serving", APP_NAME, others)
        serve.delete(APP_NAME)
        return
    serve.shutdown()
    # serve.shutdown gives up waiting after 30 s and the controller goes on: a Serve
    # started meanwhile (servekit's next start) would take over the proxies it is about
    # to kill. So the stop ends when Serve's actors are gone.
    left = serve_actors()
    deadline = time.monotonic() + SERVE_GONE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = serve_actors()
    if left:
        log.warning("%d of Serve's actors still alive %g s after its shutdown: %s",
                    len(left), SERVE_GONE_S, sorted(left))  # fmt: skip


SERVE_GONE_S = 60.0
"""How long a stop waits for Serve's controller, proxies and replicas to be gone."""


def serve_actors() -> set[str]:
    """The names of Serve's own actors alive on the cluster (none when Ray is gone)."""
    import ray

    try:
        named = ray.util.list_named_actors(all_namespaces=True)
    except Exception:  # the GCS is gone: nothing of Serve's is left
        return set()
    return {
        a["name"] for a in named if a["namespace"] == "serve" and a["name"].startswith("SERVE_")
    }


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Put SIGINT's and SIGTERM's handlers back after ``ray.init``: it installs its own
    for SIGTERM (one that exits with 15 while it starts a cluster, then one that aborts
    the process: exit 134, Ray's agents left running) in place of the clean stop the
    ``Supervisor``'s handler makes. A SIGTERM that Ray's handler took during ``ray.init``
    becomes the ``KeyboardInterrupt`` a stop during start is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except SystemExit as exc:
        if exc.code != signal.SIGTERM:
            raise
        raise KeyboardInterrupt from None
    finally:
        for sig, handler in kept.items():
            if handler is not None:
                signal.signal(sig, handler)


def _is_ray(argv: list[str]) -> bool:
    """Whether a process is one of Ray's (a worker or agent, or a binary or script of the
    ``ray`` package)."""
    return argv[0].startswith("ray::") or any("/ray/" in a for a in argv[:3])


def _origins(config: ServeConfig) -> dict[str, object] | None:
    """Each model source's fetched file, when every source is an object in a store (a
    local file has no version to compare); None otherwise."""
    from .. import zoo
    from ..storage import is_remote

    sources = [m.for_version(v).source for m in config.models for v in m.version_numbers]
    if not sources or not all(is_remote(s) for s in sources):
        return None
    return {s: zoo.resolve(s, config.cache_dir, config.storage) for s in sources}
