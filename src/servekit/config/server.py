"""Where and how a runtime listens (``ServerConfig``), Ray's options (``RayOptions``) and
the model store's (``StoreConfig``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..endpoints import Endpoints, free_port, parse_port_range
from ..recovery import Recovery
from ..tables import check_keys
from .names import MAX_BODY_BYTES

__all__ = [
    "RAY_PORTS",
    "STORE_LOADS",
    "CacheConfig",
    "RayOptions",
    "ServerConfig",
    "StoreConfig",
    "ray_port_count",
]


@dataclass(frozen=True)
class CacheConfig:
    """``[server] cache``: where the response cache keeps answers, as Triton's
    ``--cache-config``: ``{ local = { size_mb = 256 } }`` (this process, an LRU bounded in
    bytes) or ``{ redis = { url = "redis://host:6379/0" } }`` (shared by every replica).
    A model uses it with ``response_cache = true``."""

    local_size_mb: float = 0.0
    redis_url: str = ""

    def __post_init__(self) -> None:
        if not self.local_size_mb >= 0:
            raise ValueError(f"[server.cache.local] size_mb must be > 0, got {self.local_size_mb}")
        if self.local_size_mb and self.redis_url:
            raise ValueError("[server.cache]: local or redis, not both")

    @property
    def active(self) -> bool:
        return bool(self.local_size_mb or self.redis_url)

    def to_dict(self) -> dict[str, Any]:
        if self.redis_url:
            return {"redis": {"url": self.redis_url}}
        return {"local": {"size_mb": self.local_size_mb}} if self.local_size_mb else {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "server.cache") -> CacheConfig:
        check_keys(section, data, {"local", "redis"})
        local, redis = data.get("local"), data.get("redis")
        for name, table in (("local", local), ("redis", redis)):
            if table is not None and not isinstance(table, Mapping):
                raise ValueError(f"[{section}.{name}]: expected a table, got {table!r}")
        if local is not None:
            check_keys(f"{section}.local", local, {"size_mb"})
            size = local.get("size_mb")
            if isinstance(size, bool) or not isinstance(size, int | float) or size <= 0:
                raise ValueError(f"[{section}.local] size_mb must be a number > 0, got {size!r}")
        if redis is not None:
            check_keys(f"{section}.redis", redis, {"url"})
            if not str(redis.get("url", "")).startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(
                    f"[{section}.redis] url must be redis://host:port/db, got {redis.get('url')!r}"
                )
        return cls(
            local_size_mb=float(local["size_mb"]) if local else 0.0,
            redis_url=str(redis["url"]) if redis else "",
        )


@dataclass(frozen=True)
class TracingConfig:
    """``[server.tracing]``: OpenTelemetry traces of requests (``servekit.tracing``), off by
    default. ``endpoint``: the OTLP/HTTP traces URL (``http://collector:4318/v1/traces``);
    ``rate``: the fraction of requests traced (Triton's ``trace_rate`` is one in 1/rate);
    ``level``: ``timestamps`` or ``off`` (changeable at runtime, as Triton's)."""

    endpoint: str = ""
    rate: float = 0.001
    level: str = "timestamps"

    def __post_init__(self) -> None:
        if self.endpoint and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(
                f"[server.tracing] endpoint must be an OTLP/HTTP URL, got {self.endpoint!r}"
            )
        if isinstance(self.rate, bool) or not isinstance(self.rate, int | float):
            raise ValueError(f"[server.tracing] rate must be a number in [0, 1], got {self.rate!r}")
        if not 0 <= self.rate <= 1:
            raise ValueError(f"[server.tracing] rate must be in [0, 1], got {self.rate}")
        if self.level.lower() not in ("off", "timestamps"):
            raise ValueError(
                f"[server.tracing] level must be 'off' or 'timestamps', got {self.level!r}"
            )

    @property
    def active(self) -> bool:
        return bool(self.endpoint)

    def tracing(self) -> Any:
        """The server's ``Tracing`` (None without an endpoint)."""
        if not self.endpoint:
            return None
        try:
            from ..tracing import Tracing
        except ImportError as exc:
            raise ValueError(
                f"[server.tracing] needs OpenTelemetry: pip install 'servekit[tracing]' ({exc})"
            ) from None
        return Tracing(self.endpoint, self.rate, self.level)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "server.tracing") -> TracingConfig:
        if not isinstance(data, Mapping):
            raise ValueError(f"[{section}]: expected a table, got {data!r}")
        check_keys(section, data, {"endpoint", "rate", "level"}, cls)
        return cls(**data)


@dataclass(frozen=True)
class ServerConfig(Endpoints):
    """Where and how a runtime listens; the defaults are Triton's own ports."""

    host: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    front: bool = True
    """Serve ``http_port`` with servekit's hardened KServe v2 front (Triton runtimes: Triton's
    own HTTP moves to a private loopback port). Always on for ``native`` and ``ray``."""
    triton_http_port: int = 0
    triton_grpc_port: int = 0
    triton_metrics_port: int = 0
    """With the front (pytriton, triton): tritonserver's own HTTP, gRPC and metrics ports,
    on 127.0.0.1 only, behind the front's public ones (the front serves ``metrics_port``
    with tritonserver's families and its own); 0 (default) picks free ones at start. Set
    them where a firewall or a port range must know every port servekit opens."""
    inference_token: str | None = None
    """When set, inference needs it in the ``servekit-inference-token`` header / metadata."""
    control_token: str | None = None
    """When set, Triton's model control, shared memory, config, statistics, trace and
    logging APIs need it in ``servekit-control-token``, and so does changing a traffic split
    (``POST /v2/models/<m>/traffic``, every runtime); None on PyTriton = a random one."""
    log_verbose: int = 0
    """Triton's ``--log-verbose`` level; for ``native``, > 0 logs at DEBUG."""
    exit_timeout_s: int = 5
    """How long a stopping server waits for requests in flight."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Larger request bodies get a 413 from servekit's front before they are read whole."""
    keep_alive_s: float = 5.0
    """HTTP/1.1: a connection with no request in progress this long is closed (one that
    never finishes its headers, slowloris, included)."""
    max_connections: int = 1024
    """Connections servekit's HTTP server (all its ports together) and its gRPC server
    each hold at once; one more is refused at once (HTTP 503, gRPC GOAWAY)."""
    grpc_handshake_timeout_s: float = 10.0
    """servekit's gRPC server: a connection without the HTTP/2 preface this long is closed."""
    grpc_idle_timeout_s: float = 300.0
    """servekit's gRPC server: a connection with no call and no frame this long gets GOAWAY."""
    request_timeout_s: float = 30.0
    """A request whose worker process died is sent again until this long after it arrived
    (its KServe ``timeout`` parameter, when given, instead); then 504 saying the worker died."""
    max_worker_deaths: int = 2
    """A request in flight in this many worker deaths is not sent again: 400, and the same
    input is refused at once from then on (``servekit.recovery``)."""
    max_sequence_replay: int = 100
    """Requests of each live sequence the Triton runtimes' front keeps to rebuild its state
    on a restarted worker (``servekit.front.journal``); a longer sequence whose worker died
    gets an error naming it. 0 keeps none."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    """The response cache's store (``CacheConfig``); none by default."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """OpenTelemetry traces (``TracingConfig``); off by default."""

    def __post_init__(self) -> None:
        for key in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, key)
            if not 0 < port < 65536:
                raise ValueError(f"{key} must be in [1, 65535], got {port}")
        for key in ("triton_http_port", "triton_grpc_port", "triton_metrics_port"):
            port = getattr(self, key)
            if not 0 <= port < 65536:
                raise ValueError(f"{key} must be in [0, 65535] (0: a free one), got {port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for key in ("keep_alive_s", "max_connections", "grpc_handshake_timeout_s",
                    "grpc_idle_timeout_s", "request_timeout_s", "max_worker_deaths"):  # fmt: skip
            if not getattr(self, key) > 0:  # NaN too
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")

    def triton_ports(self) -> tuple[int, int, int]:
        """tritonserver's private HTTP, gRPC and metrics ports behind the front: as set, or
        free ones."""
        return (
            self.triton_http_port or free_port(),
            self.triton_grpc_port or free_port(),
            self.triton_metrics_port or free_port(),
        )

    def http_limits(self) -> dict[str, Any]:
        """servekit's HTTP/1.1 server's connection limits (``H1Server``'s keywords)."""
        return {"keep_alive_s": self.keep_alive_s, "max_connections": self.max_connections}

    def recovery(self) -> Recovery:
        """What re-sends requests a worker death cost and quarantines poison inputs."""
        return Recovery(
            timeout_s=self.request_timeout_s,
            max_deaths=self.max_worker_deaths,
            sequence_replay=self.max_sequence_replay,
        )

    def grpc_limits(self) -> dict[str, Any]:
        """servekit's gRPC server's connection limits (``GrpcH2Server``'s keywords)."""
        return {
            "handshake_timeout_s": self.grpc_handshake_timeout_s,
            "idle_timeout_s": self.grpc_idle_timeout_s,
            "max_connections": self.max_connections,
        }

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out["cache"] = self.cache.to_dict()
        if not out["cache"]:
            del out["cache"]
        if not self.tracing.active:
            del out["tracing"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "server") -> ServerConfig:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        kwargs = dict(data)
        if "cache" in data:
            kwargs["cache"] = CacheConfig.from_dict(data["cache"], f"{section}.cache")
        if "tracing" in data:
            kwargs["tracing"] = TracingConfig.from_dict(data["tracing"], f"{section}.tracing")
        return cls(**kwargs)


RAY_PORTS = (
    "GCS", "node manager", "object manager", "metrics export", "dashboard agent HTTP",
    "dashboard agent gRPC", "runtime env agent", "client server", "autoscaler metrics",
    "dashboard metrics",
)  # fmt: skip
"""The ports of a Ray that ``[ray] ports`` names first, in this order (``ray start``'s
``--port``, ``--node-manager-port``, ... and the two metrics ports Ray takes from its
environment: ``servekit.ray.head``); the rest are its worker processes'."""
MIN_RAY_WORKER_PORTS = 8


def ray_port_count(cpus: int | None = None) -> int:
    """How many ports servekit gives a Ray it starts when it chooses them (``--port-base``,
    ``compare --ports``): the named ones, and one per worker process: Ray starts one idle
    worker per CPU, and servekit's driver, Serve's controller, proxy and replicas take one
    each (``cpus``: this machine's by default)."""
    cpus = cpus or os.cpu_count() or 1
    return len(RAY_PORTS) + max(32, 2 * cpus + 16)


@dataclass(frozen=True)
class RayOptions:
    """Ray Serve's deployment knobs beyond the model's own (``instances`` = model replicas)."""

    address: str = ""
    """The Ray cluster to deploy on (``host:port`` of its head, or ``auto``); empty:
    servekit starts a Ray of its own on this machine."""
    model_cpus: float = 1.0
    """CPUs reserved per model replica."""
    model_gpus: float = 0.0
    """GPUs reserved per model replica (1: one replica per GPU, on whichever host has one)."""
    stage_cpus: float = 0.25
    """CPUs reserved per pre/postprocess replica and for the ingress."""
    stage_replicas: int = 1
    ingress_replicas: int = 1
    """Replicas of the ingress (KServe v2), at most one per host. On a cluster give it the
    host count: each host's proxy then has an ingress of its own (Ray routes to a replica
    on the proxy's node first), so losing a host costs only what ran on it."""
    max_ongoing_requests: int = 0
    """Per replica; 0 = four times the model's max batch size (at least 16). Ray's own
    default (5) would starve the Batcher."""
    ingress_batches: int = 0
    """Batches the ingress keeps in flight per model; 0 = two per model replica, plus one."""
    autoscaling: Mapping[str, Any] | None = None
    """Ray's ``autoscaling_config`` for the model deployments (replaces ``instances``)."""
    autoscale_signal: str = "servekit"
    """What ``autoscaling`` scales on: ``servekit`` (each replica's
    ``servekit_replicas_needed``, summed: ``servekit.ray.autoscale``) or ``ray`` (Ray's
    own ``target_ongoing_requests``)."""
    fuse: bool = False
    """Serve the models inside the ingress replicas: one deployment, no handle call per
    batch (the ingress takes the models' largest ``instances`` as replicas, ``model_cpus``
    each, and each replica runs one instance of each model), an image classifier's
    stages in the replica too. Cheaper per request; models
    no longer scale apart."""
    direct: bool = False
    """Each ingress replica serves HTTP on ``server.http_port`` itself (servekit's HTTP
    server, the native runtime's; every replica on a host shares the port), in place of
    Ray's HTTP proxy, whose actor call per request costs more CPU than a fast device's
    batch (``servekit.ray.direct``). Requests still reach the model deployments a batch
    per handle call, and they scale as before."""

    ports: tuple[int, ...] = ()
    """The ports of the Ray servekit starts (without ``address``): ``RAY_PORTS`` in that
    order, then one per Ray worker process (at least eight); ``"FIRST:LAST"`` in a file
    for a block. Ray Serve's replicas also each take a port the system picks (their
    inter-deployment gRPC, which Ray gives no setting): listed at start. Empty: Ray picks
    every port (``servekit serve --port-base`` fills it)."""

    def __post_init__(self) -> None:
        if isinstance(self.ports, str):
            first, last = parse_port_range(self.ports)
            object.__setattr__(self, "ports", tuple(range(first, last + 1)))
        object.__setattr__(self, "ports", tuple(int(p) for p in self.ports))
        self._check_ports()
        if self.autoscale_signal not in ("servekit", "ray"):
            raise ValueError(
                f"[ray] autoscale_signal must be 'servekit' or 'ray', got {self.autoscale_signal!r}"
            )
        if self.autoscale_signal == "servekit" and "target_ongoing_requests" in (
            self.autoscaling or {}
        ):
            raise ValueError(
                "[ray] autoscaling.target_ongoing_requests is Ray's own signal: set "
                "autoscale_signal = 'ray' to scale on it (servekit's is the default)"
            )
        if self.ingress_replicas < 1:
            raise ValueError(f"[ray] ingress_replicas must be >= 1, got {self.ingress_replicas}")

    def _check_ports(self) -> None:
        if not self.ports:
            return
        if self.address:
            raise ValueError(
                f"[ray] ports choose the ports of the Ray servekit starts; the cluster at "
                f"address = {self.address!r} has its own"
            )
        least = len(RAY_PORTS) + MIN_RAY_WORKER_PORTS
        if len(self.ports) < least:
            raise ValueError(
                f"[ray] ports: Ray needs at least {least} ({len(RAY_PORTS)} of its own, then "
                f"its worker processes'), got {len(self.ports)}: {list(self.ports)}"
            )
        bad = sorted({p for p in self.ports if not 0 < p < 65536})
        twice = sorted({p for p in self.ports if self.ports.count(p) > 1})
        if bad or twice:
            raise ValueError(
                f"[ray] ports must be distinct, in [1, 65535]: got {bad or twice}"
                + (" outside" if bad else " more than once")
            )

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        data["ports"] = list(self.ports)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "ray") -> RayOptions:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        return cls(**data)


STORE_LOADS = ("eager", "on_demand")


@dataclass(frozen=True)
class StoreConfig:
    """Many models on shared hardware: every model under ``root`` is known without being
    loaded, and the resident ones are held under ``memory_budget_mb`` by evicting the least
    recently used idle, unpinned model (``servekit.store``)."""

    root: str | None = None
    """A folder of models: ``<name>.onnx`` files, ``<name>/model.onnx`` or a Triton-style
    ``<name>/<version>/model.onnx`` (the highest version); each is served as ``<name>``."""
    memory_budget_mb: float = 0.0
    """What the resident models may take together, measured after each load and warm-up
    (0 = no budget)."""
    load: str = "eager"
    """``eager``: load every known model at start (within the budget); ``on_demand``: a
    request for a known model that is not loaded loads it and waits."""
    pin: tuple[str, ...] = ()
    """Models never evicted (loaded at start in either mode)."""
    wait_s: float = 5.0
    """How long a request waits for its model to be loaded (loads queued before it, room
    in the budget) before a 503 with Retry-After naming what holds the budget."""
    max_loads_per_s: float = 20.0
    """At most this many loads (and so evictions) a second (0: no bound)."""
    meter: bool = True
    """Charge each model what it costs alone, measured once in a quiet helper process
    (false: measure each load in the serving process, where other requests count too)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pin", tuple(self.pin))
        if self.root is not None:
            object.__setattr__(self, "root", os.fspath(self.root))
        if self.load not in STORE_LOADS:
            raise ValueError(f"[store] load must be one of {list(STORE_LOADS)}, got {self.load!r}")
        if not self.memory_budget_mb >= 0:
            raise ValueError(f"[store] memory_budget_mb must be >= 0, got {self.memory_budget_mb}")
        if not self.wait_s > 0:
            raise ValueError(f"[store] wait_s must be > 0, got {self.wait_s}")
        if not self.max_loads_per_s >= 0:
            raise ValueError(f"[store] max_loads_per_s must be >= 0, got {self.max_loads_per_s}")

    @property
    def active(self) -> bool:
        """Whether the config asks for a model store at all."""
        return self != StoreConfig()

    @property
    def budget_bytes(self) -> int:
        return int(self.memory_budget_mb * 1024 * 1024)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        data["pin"] = list(self.pin)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "store") -> StoreConfig:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)}, cls)
        return cls(**data)
