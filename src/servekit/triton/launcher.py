"""``servekit triton``: the tritonserver bundled with PyTriton on a model repository.

It assembles a backend directory (the Python backend's library and utilities, the stub
for the running Python, and ``servekit/model.py``), applies the stub's environment
(``env.py``) and runs ``tritonserver`` with Triton's own flags. Models fail to load
alone (``--exit-on-error=false``): a missing or corrupt model never takes the others down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..autoscale import AutoscalePolicy
from ..config import ServerConfig
from ..errors import CONTROL_TOKEN_HEADER, INFERENCE_TOKEN_HEADER
from ..rollout import Traffic
from ..runtime.registry import response_cache
from ..tracing import ENDPOINT_ENV, triton_trace_config
from .env import (
    TritonEnvironment,
    TritonSetupError,
    gpu_present,
    triton_environment,
)
from .logs import Workdir

log = logging.getLogger(__name__)

_ABORTED_AT_LOAD = "boost::interprocess::lock_exception"
"""What Triton's Python backend says as it aborts tritonserver, now and then, while its
stubs start under CPU starvation (seen here at model load on a 2-core machine)."""

__all__ = ["TritonOptions", "TritonProcess", "backend_directory", "backend_model_file"]

CONTROL_MODES = ("none", "poll", "explicit")


CONTROL_APIS = "model-repository,shared-memory,model-config,trace,logging"
"""Triton's restricted-API categories the control token guards."""


@dataclass(frozen=True)
class TritonOptions:
    """The tritonserver flags servekit sets: where and how it listens (``server``, the one
    ``ServerConfig``), and what only tritonserver has; anything else goes in ``extra_args``."""

    model_repository: Path
    server: ServerConfig = field(default_factory=ServerConfig)
    model_control_mode: str = "none"
    repository_poll_secs: int = 5
    load_models: tuple[str, ...] = ()
    """With ``explicit``: models to load at start (``--load-model``); empty = none."""
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.model_control_mode not in CONTROL_MODES:
            raise ValueError(
                f"model_control_mode must be one of {list(CONTROL_MODES)}, got {self.model_control_mode!r}"
            )
        if not Path(self.model_repository).is_dir():
            raise ValueError(f"model repository {self.model_repository} is not a directory")


def backend_model_file() -> Path:
    """``triton_backends/servekit/model.py``: from the source tree, or as installed data."""
    here = Path(__file__).resolve()
    candidates = [
        here.parents[3] / "triton_backends" / "servekit" / "model.py",
        Path(sys.prefix) / "share" / "servekit" / "triton_backends" / "servekit" / "model.py",
    ]
    for path in candidates:
        if path.is_file():
            return path
    raise TritonSetupError(
        f"servekit's Triton backend model.py not found (looked in {[str(p) for p in candidates]})"
    )


def backend_directory(root: Path, env: TritonEnvironment) -> Path:
    """``root/backends`` with ``python/`` (library, utilities, stub) and ``servekit/model.py``."""
    backends = root / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    source = env.tritonserver / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(source / name, python / name)
    shutil.copy2(env.stub, python / "triton_python_backend_stub")
    servekit = backends / "servekit"
    servekit.mkdir(exist_ok=True)
    shutil.copy2(backend_model_file(), servekit / "model.py")
    return backends


class TritonProcess:
    """A tritonserver process with the servekit backend; start, use, stop (or a context manager).

    ``traffic``: the split of each model served in several versions (``traffic_of``); the
    front routes them, on HTTP and on the public gRPC port (both its own with ``front``).
    """

    def __init__(
        self,
        options: TritonOptions,
        *,
        traffic: Mapping[str, Traffic] | None = None,
        autoscale: Mapping[str, AutoscalePolicy] | None = None,
        cached: Mapping[str, Callable[[], str]] | None = None,
        shed_late: Collection[str] = (),
    ) -> None:
        self.options = options
        self.shed_late = frozenset(shed_late)
        """Models whose front window sheds what cannot make its deadline (``shed_late``)."""
        self.traffic = dict(traffic or {})
        self.cached = dict(cached or {})
        """Models with ``response_cache`` (their answers kept in the front, ``[server]
        cache``): name -> the identity of what it serves."""
        self.autoscale = dict(autoscale or {})
        """Model name -> the targets of its autoscaling signal (the front computes it)."""
        if self.traffic and not options.server.front:
            raise ValueError(
                f"models {sorted(self.traffic)} have a traffic split: it runs in servekit's "
                "front (server.front = true)"
            )
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: Workdir | None = None
        self._stubs: dict[int, str] = {}
        """Python backend stubs seen: pid -> model instance."""
        self.restarts = 0
        """How many times ``wait`` restarted a tritonserver that died."""
        self.log_path: Path | None = None
        self._last_log = ""
        self._front: Any = None
        # With the front, tritonserver's endpoints keep private ports across restarts.
        s = options.server
        if s.front:
            http, grpc, metrics = s.triton_ports()
            self.triton_http_url, self.triton_grpc_url = (
                f"http://127.0.0.1:{http}",
                f"grpc://127.0.0.1:{grpc}",
            )
            self.triton_metrics_port = metrics
        else:
            self.triton_http_url, self.triton_grpc_url = s.http_url, s.grpc_url
            self.triton_metrics_port = s.metrics_port
        self.triton_metrics_url = f"http://127.0.0.1:{self.triton_metrics_port}/metrics"

    def command(self, backends: Path, env: TritonEnvironment) -> list[str]:
        o, s = self.options, self.options.server
        cmd = [
            str(env.tritonserver / "bin" / "tritonserver"),
            f"--model-repository={Path(o.model_repository).resolve()}",
            f"--backend-directory={backends}",
            f"--http-address={'127.0.0.1' if s.front else s.host}",
            f"--http-port={self.triton_http_url.rsplit(':', 1)[1]}",
            f"--grpc-address={'127.0.0.1' if s.front else s.host}",
            f"--grpc-port={self.triton_grpc_url.rsplit(':', 1)[1]}",
            f"--metrics-address={'127.0.0.1' if s.front else s.host}",
            f"--metrics-port={self.triton_metrics_port}",
            f"--model-control-mode={o.model_control_mode}",
            f"--log-verbose={s.log_verbose}",
            f"--exit-timeout-secs={s.exit_timeout_s}",
            "--exit-on-error=false",
            # Latency quantiles under the names servekit's own runtimes export too.
            "--metrics-config=summary_latencies=true",
            f"--allow-gpu-metrics={'true' if gpu_present() else 'false'}",
        ]
        for apis, header, token in (
            ("inference", INFERENCE_TOKEN_HEADER, s.inference_token),
            (CONTROL_APIS, CONTROL_TOKEN_HEADER, s.control_token),
        ):
            if token:
                cmd.append(f"--http-restricted-api={apis}:{header}={token}")
                cmd.append(f"--grpc-restricted-protocol={apis}:{header}={token}")
        if o.model_control_mode == "poll":
            cmd.append(f"--repository-poll-secs={o.repository_poll_secs}")
        t = s.tracing
        if t.active:  # tritonserver's own spans, in the trace the front passes on
            cmd += [f"--trace-config={c}" for c in triton_trace_config(t.endpoint, t.rate, t.level)]
        cmd += [f"--load-model={m}" for m in o.load_models]
        named = any("shm-region-prefix-name" in a for a in o.extra_args)
        if self._workdir is not None and not named:  # every stub region, for close to free
            prefix = self._workdir.region_prefix
            cmd.append(f"--backend-config=python,shm-region-prefix-name={prefix}")
        return cmd + list(o.extra_args)

    def start(self, timeout_s: float = 120.0) -> TritonProcess:
        """Start tritonserver (and the front, once) and wait until it is live and has finished
        its initial loads. A start that fails leaves nothing running: no stub, no shared
        memory, no folder. One that Triton's Python backend aborts with its intermittent
        ``boost::interprocess::lock_exception`` (triton-inference-server/server#8882) is
        tried once more."""
        try:
            return self._start(timeout_s)
        except TritonSetupError as exc:
            if _ABORTED_AT_LOAD not in str(exc):
                raise
            log.warning("tritonserver aborted during its initial loads (%s): starting it "
                        "once more", _ABORTED_AT_LOAD)  # fmt: skip
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> TritonProcess:
        env = triton_environment()
        if self.options.server.tracing.active:  # the servekit backend's spans go there too
            env.env[ENDPOINT_ENV] = self.options.server.tracing.endpoint
        self._workdir = Workdir(
            "servekit-tritonserver-", verbose=self.options.server.log_verbose > 0
        )
        backends = backend_directory(self._workdir.path, env)
        self.log_path = self._workdir.log_path
        with self.log_path.open("wb") as log:
            proc = self._proc = subprocess.Popen(
                self.command(backends, env),
                env=env.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self._http_ok("/v2/health/live"):
            if proc.poll() is not None:  # died, or stop() was called meanwhile
                tail = self.log_tail()
                self._stop_server(drain=False)  # its stubs, their memory, the folders
                raise TritonSetupError(f"tritonserver exited with code {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise TritonSetupError(f"tritonserver not live after {timeout_s} s:\n{tail}")
            time.sleep(0.1)
        self._stubs = self._alive_stubs()  # its initial loads' (mode none and poll load first)
        if self.options.server.front and self._front is None:
            self._start_front()
        return self

    def _start_front(self) -> None:
        from ..front import Front, TritonModels
        from ..front.demand import TritonDemand

        s = self.options.server
        recovery = s.recovery()
        cache = response_cache(s) if self.cached else None
        registry = TritonModels(
            self.triton_http_url,
            self.triton_grpc_url,
            inference_token=s.inference_token,
            control_headers={CONTROL_TOKEN_HEADER: s.control_token} if s.control_token else None,
            traffic=self.traffic,
            recovery=recovery,
            control_mode=self.options.model_control_mode,
            cached=self.cached,
            cache=cache,
            shed_late=self.shed_late,
        )
        self._front = Front(
            registry,
            self.triton_grpc_url,
            host=s.host,
            port=s.http_port,
            ready=self.is_alive,
            max_body_bytes=s.max_body_bytes,
            inference_token=s.inference_token,
            http_url=self.triton_http_url,
            traffic=self.traffic,
            grpc_port=s.grpc_port,
            control_token=s.control_token,
            exit_timeout_s=s.exit_timeout_s,
            http_limits=s.http_limits(),
            grpc_limits=s.grpc_limits(),
            demand=TritonDemand(self.triton_metrics_url, self.triton_http_url, self.autoscale),
            recovery=recovery,
            tracing=s.tracing.tracing(),
            cache=cache,
            metrics_port=s.metrics_port,
            triton_metrics_url=self.triton_metrics_url,
        ).start()

    def _http_ok(self, path: str) -> bool:
        return self._http_status(path) == 200

    def _http_status(self, path: str) -> int | None:
        """tritonserver's status for ``GET path`` on its private port; None: no answer."""
        try:
            with urllib.request.urlopen(f"{self.triton_http_url}{path}", timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (urllib.error.URLError, OSError):
            return None

    def wait_ready(self, models: Sequence[str], timeout_s: float = 120.0) -> None:
        """Wait until every named model is ready; raise with Triton's log tail if one is not."""
        deadline = time.monotonic() + timeout_s
        pending = list(models)
        while pending:
            pending = [m for m in pending if not self._http_ok(f"/v2/models/{m}/ready")]
            if not pending:
                return
            if not self.is_alive() or time.monotonic() > deadline:
                raise TritonSetupError(f"models {pending} not ready:\n{self.log_tail()}")
            time.sleep(0.1)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_text(self) -> str:
        """tritonserver's log: as far as it goes now, or, once stopped, all of it (its
        folder is gone, and a crash at exit wrote its last lines as it stopped)."""
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return self._last_log

    def stop(self) -> None:
        """Stop the front, then tritonserver: SIGTERM (Triton drains for ``exit_timeout_s``),
        then SIGKILL if it lingers."""
        if self._front is not None:
            self._front.stop()
            self._front = None
        self._stop_server()

    def _stop_server(self, *, drain: bool = True) -> int | None:
        code = None
        self._stubs = {}
        if self._workdir is not None:
            server = self._proc.pid if self._proc is not None else None
            self._workdir.stubs(server)  # their regions, for ``close`` to free after a kill
        if self._proc is not None:
            if self._proc.poll() is None and not drain:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            elif self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGTERM)
                try:
                    self._proc.wait(self.options.server.exit_timeout_s + 10)
                except subprocess.TimeoutExpired:
                    os.killpg(self._proc.pid, signal.SIGKILL)
                    self._proc.wait()
            code = self._proc.returncode
            # What it forked and left (a stub it was starting as it died): its group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc = None
        if self._workdir is not None:
            self._last_log = self.log_text()
            self._workdir.close()
            self._workdir = None
        return code

    def problem(self) -> str | None:
        """Why tritonserver is not serving (it died: a crash, a kill; or a model instance's
        worker process died, which tritonserver 2.51 neither restarts nor reports), or None."""
        if self._proc is None:
            return None
        if self._proc.poll() is not None:
            return (
                f"tritonserver {_exit_reason(self._proc.returncode)}; log ended:\n"
                f"{self.log_tail(5)}"
            )
        dead = self.dead_instances()
        return f"model instance(s) {dead}: worker process died" if dead else None

    def dead_instances(self) -> list[str]:
        """Model instances (``<model>_<n>_<device>``) whose Python backend stub died while
        tritonserver still holds the model: each stub seen is remembered; one gone is dead
        unless another stub now runs that instance (a new version's) or its model can
        unload (explicit or poll mode) and tritonserver says it is not ready."""
        alive = self._alive_stubs()
        self._stubs.update(alive)
        gone = {pid: name for pid, name in self._stubs.items() if pid not in alive}
        dead, running = [], set(alive.values())
        for pid, name in gone.items():
            model = urllib.parse.quote(name.rsplit("_", 2)[0], safe="")
            if name in running:  # replaced: a new version's stub took over (poll mode)
                del self._stubs[pid]
            elif self.options.model_control_mode == "none" or self._http_status(
                f"/v2/models/{model}/ready"
            ) in (200, None):  # nothing unloads; or still served (or tritonserver stuck on it)
                dead.append(name)
            else:
                del self._stubs[pid]  # unloaded (explicit or poll mode)
        return sorted(dead)

    def _alive_stubs(self) -> dict[int, str]:
        """Python backend stubs running now: pid -> model instance (the stub's argv[8])."""
        if self._workdir is None:
            return {}
        server = self._proc.pid if self._proc is not None else None
        stubs = self._workdir.stubs(server)
        return {pid: argv[8] for pid, argv in stubs.items() if len(argv) > 8}

    def restart(self) -> None:
        """Start tritonserver again on the same ports; the front stays up meanwhile. With
        the front, the requests in flight are re-sent (``servekit.recovery``), so the old
        tritonserver is killed at once instead of drained."""
        recovery = self._front.recovery if self._front is not None else None
        if recovery is not None:
            recovery.restarting()
        self._stop_server(drain=self._front is None)
        self.restarts += 1
        try:
            self.start()
        finally:
            if self._front is not None:  # what was loaded through the API is gone
                self._front.registry.stale()
            if recovery is not None:
                recovery.restarted()

    def reload(self) -> list[str]:
        """tritonserver reloads from its repository: ``--model-control-mode poll`` picks up
        new version folders, ``explicit`` loads on request."""
        raise ValueError(
            "tritonserver reloads models from its repository (model control mode "
            f"{self.options.model_control_mode!r}); use poll or explicit mode for live updates"
        )

    def __enter__(self) -> TritonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
