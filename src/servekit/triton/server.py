"""``servekit serve``: servekit models behind Triton's HTTP/gRPC API, through PyTriton.

Triton's own server (bundled with PyTriton) speaks KServe v2 over HTTP and gRPC,
serves metrics and does the dynamic batching; servekit supplies the runners, their
signatures and batching policies, and per-request error handling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..batching.policy import BatchingPolicy
from ..errors import ModelNotFound
from ..pipeline import image_classifier, is_image_classifier
from ..runners import load_runner
from ..runners.base import Runner
from ..runners.versioned import VersionedRunner
from .binding import infer_callable, install_error_shim, pytriton_model_config, pytriton_tensors
from .env import Endpoints, apply_triton_environment, free_port, gpu_present

__all__ = [
    "ServedModel",
    "ServerConfig",
    "TritonServer",
    "default_models",
    "kill_leftovers",
    "load_onnx",
    "model_name",
    "serve",
]

log = logging.getLogger(__name__)

DEFAULT_POLICY = BatchingPolicy(max_batch_size=32)


@dataclass(frozen=True)
class ServedModel:
    """One model to serve: a name, a Runner, its batching policy and instance count."""

    name: str
    runner: Runner
    policy: BatchingPolicy = field(default_factory=lambda: DEFAULT_POLICY)
    instance_count: int = 1

    def __post_init__(self) -> None:
        if self.instance_count < 1:
            raise ValueError(f"{self.name}: instance_count must be >= 1, got {self.instance_count}")


@dataclass(frozen=True)
class ServerConfig(Endpoints):
    """Where Triton listens; defaults are Triton's own ports."""

    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    exit_timeout_s: int = 5
    """How long Triton waits for in-flight requests when stopping."""
    access_token: str | None = None
    """Token for Triton's management APIs (shared memory, repository, statistics, trace,
    logging), which PyTriton restricts by default; None = a random one per start."""
    restricted_endpoints: tuple[str, ...] | None = None
    """APIs that need the token; None = PyTriton's defaults, () = none."""
    front: bool = False
    """Serve ``http_port`` with servekit's hardened KServe v2 front (``triton.front``),
    Triton's own HTTP endpoint moving to a private loopback port."""
    max_body_bytes: int = 64 * 1024 * 1024
    """With ``front``: larger request bodies get a 413 before they are read whole."""


def processes(prefix: str) -> dict[int, list[str]]:
    """Live (not zombie) processes whose executable lies under ``prefix``: pid -> argv
    (Linux ``/proc``; empty elsewhere)."""
    found: dict[int, list[str]] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (
                (entry / "cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
            )
            zombie = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except (OSError, IndexError):
            continue
        if argv[0].startswith(prefix) and not zombie:
            found[int(entry.name)] = argv
    return found


def kill_leftovers(prefix: str) -> int:
    """SIGKILL processes started from ``prefix`` that outlived their server; returns how many.

    When tritonserver dies at shutdown, its Python backend stubs can outlive it (their
    parent becomes init). Each holds memory; this finds them by the executable path under
    the server's private workspace.
    """
    killed = 0
    for pid in processes(prefix):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    if killed:
        log.warning("killed %d process(es) left behind under %s", killed, prefix)
    return killed


def model_name(model: str | os.PathLike[str]) -> str:
    """The served name of a zoo model or an ONNX file (its stem)."""
    return os.path.splitext(os.path.basename(os.fspath(model)))[0]


def load_onnx(
    model: str | os.PathLike[str],
    policy: BatchingPolicy = DEFAULT_POLICY,
    *,
    intra_op_threads: int | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Runner:
    """An ONNX Runtime runner for a zoo name or an ONNX file (read from disk now: what a
    reload runs again); a missing file is a ``ModelNotFound`` naming it."""
    from .. import zoo

    return load_runner(
        zoo.resolve(model, cache_dir),
        threads=intra_op_threads,
        max_batch_size=max(policy.max_batch_size, 1) if policy.max_batch_size else None,
    )


def default_models(
    model: str | os.PathLike[str] = "resnet50",
    *,
    name: str | None = None,
    policy: BatchingPolicy = DEFAULT_POLICY,
    instance_count: int = 1,
    intra_op_threads: int | None = None,
    top_k: int = 5,
    labels: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> list[ServedModel]:
    """The tensor model and, for image classifiers, ``<name>_image`` (JPEG/PNG in, top-k out).

    ``model`` is a zoo name or a path to an ONNX file whose spec is read from the graph;
    both models share one ``VersionedRunner``, so ``TritonServer.update(name, ...)``
    updates both.
    """
    name = name or model_name(model)
    runner = VersionedRunner(
        load_onnx(model, policy, intra_op_threads=intra_op_threads, cache_dir=cache_dir), name=name
    )
    served = [ServedModel(name, runner, policy, instance_count)]
    if runner.spec.batched and is_image_classifier(runner.spec):
        clf = image_classifier(runner, top_k=top_k, labels=labels)
        served.append(ServedModel(f"{name}_image", clf, policy, instance_count))
    return served


class TritonServer:
    """Triton (via PyTriton) serving servekit models; start, use, stop (or a context manager)."""

    def __init__(self, models: Sequence[ServedModel], config: ServerConfig | None = None) -> None:
        if not models:
            raise ValueError("nothing to serve: pass at least one ServedModel")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        # Every model is updatable in place: see ``update``.
        self.models = [
            m
            if isinstance(m.runner, VersionedRunner)
            else dataclasses.replace(m, runner=VersionedRunner(m.runner, name=m.name))
            for m in models
        ]
        self.config = config or ServerConfig()
        self._triton: Any = None
        self._workdir: Path | None = None
        self._front: Any = None
        self._stubs: dict[int, str] = {}
        self.restarts = 0
        """How many times ``serve`` restarted Triton after a model's worker process died."""
        self.access_token: str | None = None
        """The token the running server expects on restricted APIs (``Client(access_token=)``)."""

    def start(self) -> TritonServer:
        """Warm up every runner, then start Triton and load the models; returns once all are ready.

        Readiness for load balancers is per model: ``/v2/models/<name>/ready`` turns true
        only after that model's runner is warm and loaded. (PyTriton starts Triton empty
        and then loads the models, so ``/v2/health/ready`` is true a moment earlier; its
        local-model-store mode would avoid that but races its own handshake with the
        Python backend stubs.)
        """
        apply_triton_environment()
        from pytriton.triton import (
            Triton,
            TritonConfig,
            TritonSecurityConfig,
        )

        for m in self.models:
            m.runner.warmup()
        c = self.config
        security = TritonSecurityConfig(
            access_token=c.access_token,
            restricted_endpoints=None
            if c.restricted_endpoints is None
            else list(c.restricted_endpoints),
        )
        # A workspace servekit owns: PyTriton's default one leaves its TemporaryDirectory
        # to the garbage collector, which warns.
        self._workdir = Path(tempfile.mkdtemp(prefix="servekit-triton-"))
        triton = Triton(
            workspace=self._workdir / "workspace",
            security_config=security,
            config=TritonConfig(
                http_address="127.0.0.1" if c.front else c.host,
                http_port=free_port() if c.front else c.http_port,
                grpc_address=c.host,
                grpc_port=c.grpc_port,
                metrics_address=c.host,
                metrics_port=c.metrics_port,
                metrics_config=["summary_latencies=true"],
                allow_gpu_metrics=gpu_present(),
                log_verbose=c.log_verbose,
                exit_timeout_secs=c.exit_timeout_s,
            ),
        )
        try:
            for m in self.models:
                install_error_shim(m.name)
                spec = m.runner.spec
                triton.bind(
                    model_name=m.name,
                    infer_func=[infer_callable(m.runner, m.name) for _ in range(m.instance_count)],
                    inputs=pytriton_tensors(spec.inputs),
                    outputs=pytriton_tensors(spec.outputs),
                    config=pytriton_model_config(spec, m.policy),
                    # servekit checks outputs itself, and the error pseudo-output is not in the config.
                    strict=False,
                )
            triton.run()
            if c.front:
                from .front import Front

                self._front = Front(
                    {m.name: m.runner.spec for m in self.models},
                    c.grpc_url,
                    host=c.host,
                    port=c.http_port,
                    ready=self.is_healthy,
                    max_body_bytes=c.max_body_bytes,
                ).start()
        except BaseException:
            if self._front is not None:
                self._front.stop()
                self._front = None
            triton.stop()
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        self._triton = triton
        self.access_token = security.access_token
        # Each model instance runs in a Python backend stub, named <model>_<n>_<device> in
        # its argv.
        names = "|".join(re.escape(m.name) for m in self.models)
        instance = re.compile(rf"^(?:{names})_\d+_\d+$")
        self._stubs = {
            pid: next((a for a in argv if instance.match(a)), argv[0])
            for pid, argv in processes(str(self._workdir)).items()
            if argv[0].endswith("triton_python_backend_stub")
        }
        return self

    def dead_instances(self) -> list[str]:
        """Model instances whose Python backend stub died. Triton 2.51 still reports such
        a model ready and fails each of its requests ("Stub process ... is not healthy"),
        and PyTriton cannot start a stub again, so ``serve`` restarts Triton."""
        if not self._stubs or self._workdir is None:
            return []
        alive = processes(str(self._workdir))
        return sorted(name for pid, name in self._stubs.items() if pid not in alive)

    def is_healthy(self) -> bool:
        """Triton alive and every model instance's worker process alive."""
        return self.is_alive() and not self.dead_instances()

    def restart(self) -> None:
        """Stop Triton and start it again with the same (warm) runners and ports."""
        self._shutdown()
        self.restarts += 1
        self.start()

    def _versioned(self, name: str) -> VersionedRunner:
        for m in self.models:
            if m.name == name:
                return m.runner  # type: ignore[return-value]
        raise ModelNotFound(f"no model named {name!r}; serving {[m.name for m in self.models]}")

    def update(self, name: str, runner: Runner, version: int | None = None) -> int:
        """Serve ``runner`` as model ``name`` from the next batch on, without a reload in
        Triton: no request fails and none mixes versions (``VersionedRunner``). Returns
        the new version number; a runner that fails to warm up or has another signature
        raises and the old version keeps serving."""
        number = self._versioned(name).update(runner, version)
        log.info("%s: now serving version %d", name, number)
        return number

    def rollback(self, name: str) -> int:
        """Serve model ``name``'s previous version again; returns its number."""
        number = self._versioned(name).rollback()
        log.info("%s: rolled back to version %d", name, number)
        return number

    def version(self, name: str) -> int:
        """The version of model ``name`` new batches run on."""
        return self._versioned(name).version

    def is_alive(self) -> bool:
        return self._triton is not None and self._triton.is_alive()

    def stop(self) -> None:
        """Stop Triton (waiting up to ``exit_timeout_s`` for in-flight requests) and close runners."""
        self._shutdown()
        for m in self.models:
            m.runner.close()

    def _shutdown(self) -> None:
        if self._front is not None:
            self._front.stop()
            self._front = None
        if self._triton is not None:
            self._triton.stop()
            self._triton = None
        if self._workdir is not None:
            kill_leftovers(str(self._workdir))
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
        self._stubs = {}

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    models: Sequence[ServedModel],
    config: ServerConfig | None = None,
    reload: Callable[[TritonServer], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (what ``servekit serve`` runs); a signal during start-up
    stops the server as soon as it is up. SIGHUP calls ``reload(server)`` (a live update:
    ``servekit serve`` re-reads its model file); a reload that fails is logged and the
    serving version stays."""
    server = TritonServer(models, config)
    stop, hup, wake = threading.Event(), threading.Event(), threading.Event()

    def on_signal(event: threading.Event) -> Callable[..., None]:
        def handler(*_: object) -> None:
            event.set()
            wake.set()

        return handler

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal(stop))
        if reload is not None:
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_signal(hup))
    try:
        server.start()
        c = server.config
        log.info(
            "serving %s: HTTP %s, gRPC %s, metrics %s",
            [m.name for m in models],
            c.http_url,
            c.grpc_url,
            c.metrics_url,
        )
        while True:
            wake.wait(1.0)
            wake.clear()
            if hup.is_set() and reload is not None:
                hup.clear()
                try:
                    reload(server)
                except Exception as exc:  # a failed update must not stop the serving version
                    log.error("reload failed, the serving version stays: %s", exc)
            if stop.is_set():
                break
            if not server.is_alive():
                log.error("Triton stopped unexpectedly")
                break
            dead = server.dead_instances()
            if dead:
                log.error("model instance(s) %s: worker process died; restarting Triton", dead)
                server.restart()
                log.info("Triton restarted (%d so far)", server.restarts)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop()
