"""The ``pytriton`` runtime: servekit models behind Triton's HTTP/gRPC API, through PyTriton.

Triton's own server (bundled with PyTriton) speaks KServe v2 over HTTP and gRPC,
serves metrics and does the dynamic batching; servekit supplies the runners, their
signatures and batching policies, and per-request error handling.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from ..config import ServeConfig, ServerConfig
from ..protocol.pbtxt import budget_parameters
from ..runners.base import Runner
from ..runners.broken import broken
from ..runtime.base import ServedModel, is_decoupled, refuse_decoupled, static_budgets
from ..runtime.registry import ServedModels, response_cache, served_name, watched_identity
from ..tracing import Tracing, triton_trace_config
from ..triton.env import apply_triton_environment, gpu_present
from ..triton.logs import Workdir
from .binding import infer_callable, install_error_shim, install_parameters, pytriton_tensors

__all__ = ["TritonServer"]

CONTROL_ENDPOINTS = ("model-repository", "shared-memory", "trace", "logging")
"""Triton's API categories the control token guards on PyTriton: what changes the server
(model control, shared-memory registration, trace and log settings). Statistics stay open,
as on tritonserver by default (PyTriton's own default restricts them too)."""

log = logging.getLogger(__name__)


def _windows(bound: dict[ServedModel, str]) -> dict[str, Any]:
    """Each bound model's front window (``front.window``), where it gets one."""
    from ..front.window import Window, limit_of

    out = {}
    for m, name in bound.items():
        limit = limit_of(m.policy, m.runner.spec.max_batch_size, m.instance_count)
        if limit:
            out[name] = Window(
                name, limit, shed_late=m.policy.shed_late, queue=m.policy.default_queue_policy
            )
    return out


class TritonServer:
    """Triton (via PyTriton) serving servekit models; start, use, stop (or a context manager)."""

    def __init__(
        self,
        models: Sequence[ServedModel] = (),
        config: ServerConfig | None = None,
        *,
        serve_config: ServeConfig | None = None,
    ) -> None:
        if not models and serve_config is None:
            raise ValueError("nothing to serve: pass at least one ServedModel")
        # Every model is updatable in place: see ``update``.
        self.models = ServedModels(serve_config, models)
        """What it serves: each model's versions and traffic (servekit's front routes)."""
        self.server = config or ServerConfig()
        self.config = serve_config
        self._triton: Any = None
        self._workdir: Workdir | None = None
        self._front: Any = None
        self._tracing: Tracing | None = None
        self._stubs: dict[int, str] = {}
        self._ports: tuple[int, int, int] | None = None
        """tritonserver's HTTP and gRPC ports, chosen once."""
        self.restarting = False
        self.restarts = 0
        """How many times ``serve`` restarted Triton after a model's worker process died."""
        self.access_token: str | None = None
        """The token the running server expects on restricted APIs (``Client(access_token=)``)."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> TritonServer:
        """Serve every model of ``config`` (loaded by ``start``, see ``load_models``)."""
        return cls(config=config.check("pytriton").server, serve_config=config)

    def start(self) -> TritonServer:
        """Warm up every runner, then start Triton and load the models; returns once all are ready.

        Readiness for load balancers is per model: ``/v2/models/<name>/ready`` turns true
        only after that model's runner is warm and loaded. (PyTriton starts Triton empty
        and then loads the models, so ``/v2/health/ready`` is true a moment earlier; its
        local-model-store mode would avoid that but races its own handshake with the
        Python backend stubs.)
        """
        apply_triton_environment()
        for line in static_budgets(self.config) if self.config else ():
            log.warning("%s", line)
        if self.server.log_verbose == 0:  # PyTriton's own banner and chatter: debug
            logging.getLogger("pytriton").setLevel(logging.WARNING)
        from pytriton.triton import (
            Triton,
            TritonConfig,
            TritonSecurityConfig,
        )

        # Loaded here, so a signal can interrupt it (``Supervisor``). Triton's model for
        # each: PyTriton binds one version per Triton model. PyTriton schedules neither
        # sequences nor a decoupled model's cancellation: the front serves those itself.
        c = self.server
        loaded = self.models.load()
        # A model whose set-up failed (``runners.broken``) is the front's too: it answers
        # for it, not ready with the reason, where tritonserver would call it ready.
        local = {
            m.name for m in loaded
            if m.sequence is not None or is_decoupled(m.runner) or broken(m.runner)
        }  # fmt: skip
        if not c.front:
            for m in loaded:
                refuse_decoupled(m.runner, m.name, "pytriton with server.front = false")
        bound = {m: served_name(m) for m in loaded if m.name not in local}
        security = TritonSecurityConfig(
            access_token=c.control_token, restricted_endpoints=list(CONTROL_ENDPOINTS)
        )
        # A workspace servekit owns: PyTriton's default one leaves its TemporaryDirectory
        # to the garbage collector, which warns.
        # The front serves the public HTTP and gRPC ports; tritonserver's are private and
        # outlive a restart: the front keeps sending there.
        if self._ports is None:
            self._ports = (
                c.triton_ports() if c.front else (c.http_port, c.grpc_port, c.metrics_port)
            )
        triton_http_port, triton_grpc_port, triton_metrics_port = self._ports
        triton_metrics = f"http://127.0.0.1:{triton_metrics_port}/metrics"
        if self._front is None:  # one per run: the front's spans and the binding's
            self._tracing = c.tracing.tracing()
        self._workdir = Workdir("servekit-triton-", verbose=c.log_verbose > 0)
        workdir = self._workdir.path
        triton = Triton(
            workspace=workdir / "workspace",
            security_config=security,
            config=TritonConfig(
                http_address="127.0.0.1" if c.front else c.host,
                http_port=triton_http_port,
                grpc_address="127.0.0.1" if c.front else c.host,
                grpc_port=triton_grpc_port,
                metrics_address="127.0.0.1" if c.front else c.host,
                metrics_port=triton_metrics_port,
                metrics_config=["summary_latencies=true"],
                allow_gpu_metrics=gpu_present(),
                log_verbose=c.log_verbose,
                log_file=self._workdir.log_path,
                exit_timeout_secs=c.exit_timeout_s,
                trace_config=(
                    triton_trace_config(c.tracing.endpoint, c.tracing.rate, c.tracing.level)
                    if c.tracing.active
                    else None
                ),
            ),
        )
        try:
            for m in bound:
                install_error_shim(bound[m], overlap=m.overlaps)
                spec = m.runner.spec
                batches = m.policy.effective_max_batch_size(spec.max_batch_size)
                install_parameters(
                    bound[m], budget_parameters(m.policy, "fixed") if batches else {}
                )
                triton.bind(
                    model_name=bound[m],
                    infer_func=[
                        infer_callable(m.runner, bound[m], self._tracing, overlap=m.overlaps)
                        for _ in range(m.instance_count)
                    ],
                    inputs=pytriton_tensors(spec.inputs),
                    outputs=pytriton_tensors(spec.outputs),
                    config=m.policy.to_pytriton(spec.max_batch_size),
                    # servekit checks outputs itself, and the error pseudo-output is not in the config.
                    strict=False,
                )
            triton.run()
            if c.front and self._front is None:  # the front outlives a restart
                cache = response_cache(c)
                from ..front import Front
                from ..front.demand import TritonDemand

                self._front = Front(
                    {bound[m]: m.runner.spec for m in bound},
                    f"grpc://127.0.0.1:{triton_grpc_port}",
                    host=c.host,
                    port=c.http_port,
                    ready=self.is_healthy,
                    max_body_bytes=c.max_body_bytes,
                    http_url=f"http://127.0.0.1:{triton_http_port}",
                    control_headers={"triton-access-token": security.access_token or ""},
                    traffic=self.models.traffic,
                    routes=self.models.routes(local),
                    # Behind the cache too: a decoupled model asking for it is refused by name.
                    local=self.models.batch(cache, only=local) if local else None,
                    grpc_port=c.grpc_port,
                    control_token=c.control_token,
                    exit_timeout_s=c.exit_timeout_s,
                    http_limits=c.http_limits(),
                    grpc_limits=c.grpc_limits(),
                    demand=TritonDemand(
                        triton_metrics,
                        f"http://127.0.0.1:{triton_http_port}",
                        self.config.autoscale_policies() if self.config else {},
                    ),
                    recovery=c.recovery(),
                    tracing=self._tracing,
                    cached={
                        m.name: watched_identity(m, config)
                        for config in ([self.config] if self.config else [])
                        for m in config.models
                        if m.response_cache and m.name not in local
                    },
                    cache=cache,
                    metrics_port=c.metrics_port,
                    triton_metrics_url=triton_metrics,
                    windows=_windows(bound),
                ).start()
        except BaseException:
            if self._front is not None and not self.restarting:
                self._front.stop()
                self._front = None
            triton.stop()
            self._workdir.close()
            self._workdir = None
            raise
        self._triton = triton
        self.access_token = security.access_token
        # Each model instance runs in a Python backend stub, named <model>_<n>_<device> in
        # its argv.
        names = "|".join(re.escape(name) for name in bound.values()) or "(?!)"
        instance = re.compile(rf"^(?:{names})_\d+_\d+$")
        self._stubs = {
            pid: next((a for a in argv if instance.match(a)), argv[0])
            for pid, argv in self._workdir.stubs().items()
        }
        return self

    def dead_instances(self) -> list[str]:
        """Model instances whose Python backend stub died. Triton 2.51 still reports such
        a model ready and fails each of its requests ("Stub process ... is not healthy"),
        and PyTriton cannot start a stub again, so ``serve`` restarts Triton."""
        if not self._stubs or self._workdir is None:
            return []
        alive = self._workdir.stubs()
        return sorted(name for pid, name in self._stubs.items() if pid not in alive)

    def problem(self) -> str | None:
        if not self.is_alive():
            return "Triton stopped unexpectedly"
        dead = self.dead_instances()
        if dead:
            return f"model instance(s) {dead}: worker process died"
        return None

    def reload(self) -> list[str]:
        """Read each configured model's file again and swap it in live (``update``)."""
        return self.models.reload()

    def is_healthy(self) -> bool:
        """Triton alive and every model instance's worker process alive."""
        return self.is_alive() and not self.dead_instances()

    def restart(self) -> None:
        """Start Triton again with the same (warm) runners and ports. The front stays up
        and re-sends the requests in flight (``servekit.recovery``), so Triton is killed
        at once instead of drained."""
        self.restarting = True
        recovery = self._front.recovery if self._front is not None else None
        if recovery is not None:
            recovery.restarting()
        try:
            self._shutdown(keep_front=True)
            self.restarts += 1
            self.start()
        finally:
            self.restarting = False
            if recovery is not None:
                recovery.restarted()

    def update(self, name: str, runner: Runner, version: int | None = None) -> int:
        """Serve ``runner`` as model ``name`` from the next batch on, without a reload in
        Triton: no request fails and none mixes versions (``VersionedRunner``). Returns
        the new version number; a runner that fails to warm up or has another signature
        raises and the old version keeps serving."""
        number = self.models.runner(name).update(runner, version)
        log.info("%s: reloaded (reload %d)", name, number - 1)
        return number

    def rollback(self, name: str) -> int:
        """Serve model ``name``'s previous version again; returns its number."""
        number = self.models.runner(name).rollback()
        log.info("%s: rolled back to version %d", name, number)
        return number

    def version(self, name: str) -> int:
        """The version of model ``name`` new batches run on."""
        return self.models.runner(name).version

    def is_alive(self) -> bool:
        return self._triton is not None and self._triton.is_alive()

    def stop(self) -> None:
        """Stop Triton (waiting up to ``exit_timeout_s`` for in-flight requests) and close runners."""
        self._shutdown()
        self.models.close()

    def _shutdown(self, *, keep_front: bool = False) -> None:
        if self._front is not None and not keep_front:
            self._front.stop()
            self._front = None
        if keep_front and self._front is not None and self._workdir is not None:
            self._workdir.kill_leftovers()  # the front re-sends what was in flight
        if self._triton is not None:
            self._triton.stop()
            self._triton = None
        if self._workdir is not None:
            self._workdir.close()
            self._workdir = None
        self._stubs = {}

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
