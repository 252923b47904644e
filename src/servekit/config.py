"""``ServeConfig``: what to serve and how, one description consumed by every runtime.

Built from a TOML or YAML file and/or command-line flags; every default lives here once.
Each runtime (``native``, ``pytriton``, ``triton``, ``ray``) takes a ``ServeConfig`` and
nothing else, and a knob a runtime cannot honour is an error naming the knob and the
runtime (``ServeConfig.check``), never silently dropped.

::

    runtime = "pytriton"            # native | pytriton | triton | ray

    [server]
    http_port = 8000                # also grpc_port, metrics_port, host, front, tokens
    front = true

    [[models]]
    source = "resnet50"             # zoo name or path to an .onnx file
    name = "resnet50"               # default: the zoo name or the file's stem
    engine = "onnxruntime"          # onnxruntime | tensorrt | torch
    instances = 2                   # Triton instance_group count / Ray replicas / Batcher threads
    threads = 1                     # ONNX Runtime intra-op threads per instance
    top_k = 5                       # the <name>_image model's answers
    [models.batching]               # BatchingPolicy (Triton's dynamic_batching)
    max_batch_size = 16
    preferred_batch_sizes = [4, 8]
    max_queue_delay_us = 500
    [models.batching.queue]         # its default QueuePolicy
    max_queue_size = 64

A file with one model may put the model's keys at the top level and ``[batching]`` beside
them (``model = "resnet50"`` is ``source``), as earlier servekit versions wrote it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .autoscale import AutoscalePolicy
from .batching.policy import BatchingPolicy
from .custom import is_import_path
from .endpoints import Endpoints
from .recovery import Recovery
from .rollout.policy import CanaryPolicy, ModelVersion, TrafficPolicy
from .runners import ENGINES
from .storage import StorageConfig, is_remote
from .tables import check_keys

__all__ = [
    "ENGINES",
    "MAX_BODY_BYTES",
    "PRECISIONS",
    "RUNTIMES",
    "ModelConfig",
    "RayOptions",
    "ServeConfig",
    "ServerConfig",
    "StoreConfig",
    "image_model_name",
    "load_config",
    "model_name",
    "split_version_name",
    "version_model_name",
]

RUNTIMES = ("pytriton", "triton", "native", "ray")
"""``pytriton``: PyTriton (Triton's C++ batcher, servekit's runners in Python backend stubs);
``triton``: tritonserver with servekit's Triton backend on a repository rendered from the
config; ``native``: servekit's own KServe v2 server in one process; ``ray``: Ray Serve."""
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The default request size limit (``ServerConfig.max_body_bytes``), for every server."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def model_name(source: str | os.PathLike[str]) -> str:
    """The served name of a zoo model or an ONNX file (its stem); for an object in a store
    laid out as a repository (``.../<name>/model.onnx``, ``.../<name>/<version>/model.onnx``)
    the name's folder."""
    text = os.fspath(source)
    if is_import_path(text):  # your own model: the attribute it names
        return text.rpartition(":")[2].rpartition(".")[2]
    parts = [p for p in text.split("/") if p]
    if is_remote(text) and parts[-1] == "model.onnx" and len(parts) > 3:
        folder = parts[-2] if not parts[-2].isdigit() or len(parts) < 5 else parts[-3]
        return folder
    return os.path.splitext(os.path.basename(text))[0]


def image_model_name(name: str) -> str:
    """The name of the image model (encoded images in, top-k out) served beside ``name``."""
    return f"{name}_image"


def version_model_name(name: str, version: int) -> str:
    """The one spelling of a version's own served name, on every runtime: the Triton model
    that serves version ``version`` (> 1) of ``name`` on PyTriton (which binds one version
    per Triton model), a Batcher's name on native, a chain's key in Ray's ingress; the
    front routes ``name`` to it."""
    return f"{name}.v{version}"


def split_version_name(served: str) -> tuple[str, int]:
    """``version_model_name``'s way back: ``(name, version)``; a plain name is version 1."""
    name, dot, number = served.rpartition(".v")
    if dot and number.isdigit() and int(number) > 1:
        return name, int(number)
    return served, 1


@dataclass(frozen=True)
class ModelConfig:
    """One model: where it comes from, which engine runs it, how it is batched and scaled."""

    source: str = "resnet50"
    """Zoo model name, path to an ONNX file, or your own model's import path
    (``module:attribute``: a ``servekit.Model`` subclass, an ``@infer_function``, or a
    ``Runner`` class)."""
    name: str = ""
    """Served name; empty = ``model_name(source)``."""
    engine: str = "onnxruntime"
    precision: str = "fp32"
    """What the engine builds at load (TensorRT, Torch); ONNX Runtime runs the file as
    written (``servekit optimize`` makes INT8/FP16 files)."""
    device: str | None = None
    """CUDA ordinal (TensorRT) or torch device (Torch); None = the engine's default."""
    batching: BatchingPolicy = field(default_factory=BatchingPolicy)
    """``max_batch_size`` 0 = the model's own (64 for an ONNX file with a dynamic batch)."""
    instances: int = 1
    """Triton's instance_group count, Ray's model replicas, the Batcher's worker threads."""
    threads: int | None = None
    """ONNX Runtime intra-op threads per instance; None = ONNX Runtime's default."""
    labels: str | None = None
    """Class names, one per line, for the image model (default: the model's own metadata)."""
    top_k: int = 5
    image: bool = True
    """Also serve ``<name>_image`` (encoded images in, top-k out) for an image classifier."""
    version: int = 1
    """The number ``source`` is served as: 1, except where a ``[store]`` root's Triton
    layout says otherwise (``<name>/3/model.onnx`` is version 3)."""
    versions: tuple[ModelVersion, ...] = ()
    """Versions beside version 1 (``source``), each with the same signature; every one is
    loaded and served under the model's name (``/versions/<v>/`` names one)."""
    traffic: TrafficPolicy | None = None
    """How requests that name no version split over the versions (default: all to 1)."""
    canary: CanaryPolicy | None = None
    """The server's own verdict on the smallest share against the largest (needs ``traffic``)."""
    autoscale: AutoscalePolicy = field(default_factory=AutoscalePolicy)
    """The targets of ``servekit_replicas_needed``, the autoscaling signal (``servekit.autoscale``)."""
    path: str | None = None
    """Your own model's folder, put first on ``sys.path`` in each process that imports it
    (default: the working directory the config was made in)."""
    args: Mapping[str, Any] = field(default_factory=dict)
    """``[models.args]``: keyword arguments for your own model's ``setup`` (or its
    ``Runner`` class)."""
    steps: tuple[ModelConfig, ...] = ()
    """``[[models.steps]]``: a pipeline, served as this one model: each step (a zoo model,
    an ONNX file, your own code, a stage such as ``servekit.stages:Preprocess``) takes the
    request's tensors or an earlier step's outputs by name; ``source`` is unused."""

    def __post_init__(self) -> None:
        if isinstance(self.autoscale, Mapping):
            object.__setattr__(self, "autoscale", AutoscalePolicy.from_dict(self.autoscale))
        object.__setattr__(self, "source", os.fspath(self.source))
        if self.steps:
            self._check_steps()
        if not self.name:
            object.__setattr__(self, "name", model_name(self.source))
        if not _NAME.match(self.name):
            raise ValueError(
                f"model name must be letters, digits, '_', '.' or '-', got {self.name!r}"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {list(ENGINES)}, got {self.engine!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {self.precision!r}")
        for key in ("instances", "top_k"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.labels is not None:
            object.__setattr__(self, "labels", os.fspath(self.labels))
        self._check_code()
        self._check_rollout()

    @property
    def is_code(self) -> bool:
        """Whether ``source`` is your own Python model (an import path)."""
        return not self.steps and is_import_path(self.source)

    @property
    def has_file(self) -> bool:
        """Whether ``source`` is a model file (a zoo name, a path, an object): not code,
        not a pipeline."""
        return not self.steps and not self.is_code

    def _check_steps(self) -> None:
        if not self.name:
            raise ValueError("a pipeline ([[models.steps]]) needs a name")
        steps = tuple(
            s if isinstance(s, ModelConfig) else ModelConfig.from_dict(s, f"{self.name}.steps.{i}")
            for i, s in enumerate(self.steps)
        )
        object.__setattr__(self, "steps", steps)
        for i, step in enumerate(steps):
            if step.steps or step.versions or step.traffic or step.canary:
                raise ValueError(
                    f"model {self.name!r}: step {i} ({step.name}) has steps, versions or a "
                    "traffic split of its own; a pipeline's steps are single models"
                )
        if self.versions:
            raise ValueError(
                f"model {self.name!r}: a pipeline has no [[models.versions]] yet; serve each "
                "version as a pipeline of its own"
            )
        object.__setattr__(self, "source", "pipeline")
        object.__setattr__(self, "image", False)

    def _check_code(self) -> None:
        if not isinstance(self.args, Mapping):
            raise ValueError(
                f"model {self.name!r}: [models.args] must be a table, got {self.args!r}"
            )
        object.__setattr__(self, "args", dict(self.args))
        if self.path is not None:
            object.__setattr__(self, "path", os.path.abspath(os.fspath(self.path)))
        elif self.is_code:  # where the name was given, for processes that start elsewhere
            object.__setattr__(self, "path", os.getcwd())
        if not self.is_code:
            for key in ("path", "args"):
                if getattr(self, key):
                    raise ValueError(
                        f"model {self.name!r}: {key} is for your own model (source = "
                        f'"module:attribute"), not {self.source!r}'
                    )
        elif self.engine != "onnxruntime" or self.precision != "fp32":
            raise ValueError(
                f"model {self.name!r}: {self.source} is your own code: engine and precision "
                f"are its own, not {self.engine!r}/{self.precision!r}"
            )

    def _check_rollout(self) -> None:
        versions = tuple(
            v if isinstance(v, ModelVersion) else ModelVersion.from_dict(v) for v in self.versions
        )
        object.__setattr__(self, "versions", versions)
        if self.version < 1:
            raise ValueError(f"model {self.name!r}: version must be >= 1, got {self.version}")
        numbers = [self.version, *(v.version for v in versions)]
        if len(set(numbers)) != len(numbers):
            raise ValueError(f"model {self.name!r}: versions must be unique, got {numbers}")
        if isinstance(self.traffic, Mapping):
            object.__setattr__(self, "traffic", TrafficPolicy.from_dict(self.traffic))
        if isinstance(self.canary, Mapping):
            object.__setattr__(self, "canary", CanaryPolicy.from_dict(self.canary))
        traffic = self.traffic
        if traffic is not None:
            named = sorted({*traffic.split, *([traffic.shadow] if traffic.shadow else [])})
            unknown = [v for v in named if v not in numbers]
            if unknown:
                raise ValueError(
                    f"model {self.name!r}: [models.traffic] names version(s) {unknown}; "
                    f"the model has {numbers} (add them under [[models.versions]])"
                )
        judged = {*traffic.split, traffic.shadow} - {None} if traffic is not None else set()
        if self.canary is not None and len(judged) < 2:
            raise ValueError(
                f"model {self.name!r}: [models.canary] needs a [models.traffic] split over "
                "two versions, or a shadow beside one (the canary is the smaller share)"
            )

    @property
    def version_numbers(self) -> tuple[int, ...]:
        """Its own version (1 but in a store's Triton layout) and every version beside it."""
        return (self.version, *(v.version for v in self.versions))

    def for_version(self, version: int) -> ModelConfig:
        """The model as one of its versions: that version's source, no rollout of its own."""
        sources = {self.version: self.source, **{v.version: v.source for v in self.versions}}
        if version not in sources:
            raise ValueError(
                f"model {self.name!r} has no version {version}; it has {sorted(sources)}"
            )
        source = sources[version]
        return dataclasses.replace(
            self, source=source, name=self.name, versions=(), traffic=None, canary=None
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``[[models]]`` table (``from_dict``'s inverse); None values are left out."""
        rollout = ("batching", "versions", "traffic", "canary", "autoscale", "steps")
        data = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in rollout and getattr(self, f.name) is not None
        }
        data["batching"] = self.batching.to_dict()
        if self.version == 1:
            del data["version"]
        if not self.args:
            del data["args"]
        if self.steps:
            data["steps"] = [s.to_dict() for s in self.steps]
            del data["source"], data["image"]
        if self.versions:
            data["versions"] = [dataclasses.asdict(v) for v in self.versions]
        if self.traffic is not None:
            data["traffic"] = self.traffic.to_dict()
        if self.canary is not None:
            data["canary"] = self.canary.to_dict()
        if self.autoscale != AutoscalePolicy():
            data["autoscale"] = self.autoscale.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "models") -> ModelConfig:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)})
        kwargs = dict(data)
        kwargs["batching"] = BatchingPolicy.from_dict(
            data.get("batching", {}), f"{section}.batching"
        )
        raw = data.get("versions", [])
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise ValueError(f"[[{section}.versions]]: expected a list of tables, got {raw!r}")
        kwargs["versions"] = tuple(
            ModelVersion.from_dict(v, f"{section}.versions.{i}") for i, v in enumerate(raw)
        )
        steps = data.get("steps", [])
        if not isinstance(steps, Sequence) or isinstance(steps, str):
            raise ValueError(f"[[{section}.steps]]: expected a list of tables, got {steps!r}")
        kwargs["steps"] = tuple(
            ModelConfig.from_dict(v, f"{section}.steps.{i}") for i, v in enumerate(steps)
        )
        if "traffic" in data:
            kwargs["traffic"] = TrafficPolicy.from_dict(data["traffic"], f"{section}.traffic")
        if "canary" in data:
            kwargs["canary"] = CanaryPolicy.from_dict(data["canary"], f"{section}.canary")
        if "autoscale" in data:
            kwargs["autoscale"] = AutoscalePolicy.from_dict(
                data["autoscale"], f"{section}.autoscale"
            )
        return cls(**kwargs)


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

    def __post_init__(self) -> None:
        for key in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, key)
            if not 0 < port < 65536:
                raise ValueError(f"{key} must be in [1, 65535], got {port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for key in ("keep_alive_s", "max_connections", "grpc_handshake_timeout_s",
                    "grpc_idle_timeout_s", "request_timeout_s", "max_worker_deaths"):  # fmt: skip
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")

    def http_limits(self) -> dict[str, Any]:
        """servekit's HTTP/1.1 server's connection limits (``H1Server``'s keywords)."""
        return {"keep_alive_s": self.keep_alive_s, "max_connections": self.max_connections}

    def recovery(self) -> Recovery:
        """What re-sends requests a worker death cost and quarantines poison inputs."""
        return Recovery(timeout_s=self.request_timeout_s, max_deaths=self.max_worker_deaths)

    def grpc_limits(self) -> dict[str, Any]:
        """servekit's gRPC server's connection limits (``GrpcH2Server``'s keywords)."""
        return {
            "handshake_timeout_s": self.grpc_handshake_timeout_s,
            "idle_timeout_s": self.grpc_idle_timeout_s,
            "max_connections": self.max_connections,
        }

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "server") -> ServerConfig:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)})
        return cls(**data)


@dataclass(frozen=True)
class RayOptions:
    """Ray Serve's deployment knobs beyond the model's own (``instances`` = model replicas)."""

    model_cpus: float = 1.0
    """CPUs reserved per model replica."""
    stage_cpus: float = 0.25
    """CPUs reserved per pre/postprocess replica and for the ingress."""
    stage_replicas: int = 1
    max_ongoing_requests: int = 0
    """Per replica; 0 = four times the model's max batch size (at least 16). Ray's own
    default (5) would starve the Batcher."""
    ingress_batches: int = 0
    """Batches the ingress keeps in flight per model; 0 = two per model replica, plus one."""
    autoscaling: Mapping[str, Any] | None = None
    """Ray's ``autoscaling_config`` for the model deployments (replaces ``instances``)."""
    fuse: bool = False
    """Serve tensor models inside the ingress replicas: one deployment, no handle call per
    batch (the ingress takes the models' largest ``instances`` as replicas, ``model_cpus``
    each). Cheaper per request; models no longer scale apart. Image classifiers keep
    their stage deployments, so they cannot be fused."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], section: str = "ray") -> RayOptions:
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)})
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
        if self.memory_budget_mb < 0:
            raise ValueError(f"[store] memory_budget_mb must be >= 0, got {self.memory_budget_mb}")
        if self.wait_s <= 0:
            raise ValueError(f"[store] wait_s must be > 0, got {self.wait_s}")
        if self.max_loads_per_s < 0:
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
        check_keys(section, data, {f.name for f in dataclasses.fields(cls)})
        return cls(**data)


_IN_PROCESS = (
    "native runs models in the server's own process: no worker dies alone, and a crash "
    "takes the server with it (run several replicas, or the triton or ray runtime)"
)
# Knobs a runtime cannot honour: set to anything but the default, they are an error.
_UNSUPPORTED: dict[str, dict[str, str]] = {
    "pytriton": {
        "ray": "Ray deployment options",
        "store": "PyTriton cannot unload a model (pytriton#21)",
        "inference_token": "PyTriton's tritonserver takes one access token, the control_token, "
        "and servekit's front does not check an inference token in front of it",
    },
    "triton": {
        "ray": "Ray deployment options",
        "store": "tritonserver loads each model in a stub process of its own, outside the "
        "store's measure and eviction: use servekit triton --model-control-mode explicit and "
        "the repository API (load/unload pass through the front)",
    },
    "native": {
        "ray": "Ray deployment options",
        "request_timeout_s": _IN_PROCESS,
        "max_worker_deaths": _IN_PROCESS,
    },
    "ray": {
        "grpc_port": "Ray's ingress is HTTP only",
        "metrics_port": "metrics are served on the HTTP port at /metrics",
        "front": "Ray's ingress is always servekit's front",
        "log_verbose": "Ray logs through its own settings",
        "keep_alive_s": "Ray's HTTP proxy keeps its own connections",
        "max_connections": "Ray's HTTP proxy keeps its own connections",
        "grpc_handshake_timeout_s": "Ray's ingress is HTTP only",
        "grpc_idle_timeout_s": "Ray's ingress is HTTP only",
    },
}


@dataclass(frozen=True)
class ServeConfig:
    """Models, the server they are served on, and the runtime serving them."""

    models: tuple[ModelConfig, ...] = (ModelConfig(),)
    server: ServerConfig = field(default_factory=ServerConfig)
    runtime: str = "pytriton"
    cache_dir: str | None = None
    """Zoo model cache (default ``$SERVEKIT_CACHE`` or ``~/.cache/servekit/models``)."""
    ray: RayOptions = field(default_factory=RayOptions)
    store: StoreConfig = field(default_factory=StoreConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    """How ``s3://`` and ``gs://`` sources are reached and cached (``servekit.storage``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if isinstance(self.store, Mapping):
            object.__setattr__(self, "store", StoreConfig.from_dict(self.store))
        if isinstance(self.storage, Mapping):
            object.__setattr__(self, "storage", StorageConfig.from_dict(self.storage))
        if not self.models and self.store.root is None:
            raise ValueError(
                "nothing to serve: a ServeConfig needs at least one model or a [store] root"
            )
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {list(RUNTIMES)}, got {self.runtime!r}")
        served = [n for m in self.models for n in (m.name, image_model_name(m.name))[: 1 + m.image]]
        served += [
            version_model_name(m.name, v) for m in self.models for v in m.version_numbers[1:]
        ]
        if len(set(served)) != len(served):
            raise ValueError(f"served model names must be unique, got {served}")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))

    def autoscale_policies(self) -> dict[str, AutoscalePolicy]:
        """Model name -> its ``[models.autoscale]``: what each runtime's signal reads."""
        return {m.name: m.autoscale for m in self.models}

    def check(self, runtime: str | None = None) -> ServeConfig:
        """Raise ``ValueError`` naming every knob set here that ``runtime`` (default: this
        config's) cannot honour; returns self. Each runtime is checked once per config:
        the entry points (the CLI, each runtime) may all ask."""
        runtime = runtime or self.runtime
        checked: set[str] = vars(self).setdefault("_checked", set())
        if runtime not in checked:
            self._check(runtime)
            checked.add(runtime)
        return self

    def _check(self, runtime: str) -> None:
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {list(RUNTIMES)}, got {runtime!r}")
        default_server, problems = ServerConfig(), []
        for knob, why in _UNSUPPORTED[runtime].items():
            if knob == "ray":
                if self.ray != RayOptions():
                    problems.append(f"[ray] ({why})")
            elif knob == "store":
                if self.store.active:
                    problems.append(f"[store] ({why})")
            elif getattr(self.server, knob) != getattr(default_server, knob):
                problems.append(f"server.{knob} = {getattr(self.server, knob)!r} ({why})")
        problems += [
            f"models.{m.name}: version = {m.version} (the number a [store] root's Triton "
            "layout gives a model's folder; versions beside it go in [[models.versions]])"
            for m in self.models
            if m.version != 1
        ]
        if runtime in ("pytriton", "triton") and not self.server.front:
            problems += [
                f"server.{knob} = {getattr(self.server, knob)!r} (with server.front = false "
                "the public gRPC port is tritonserver's)"
                for knob in ("grpc_handshake_timeout_s", "grpc_idle_timeout_s")
                if getattr(self.server, knob) != getattr(default_server, knob)
            ]
            problems += [
                f"models.{m.name}: versions and [models.traffic] with server.front = false "
                "(on the Triton runtimes the split runs in servekit's front)"
                for m in self.models
                if m.versions or m.traffic or m.canary
            ]
        if problems:
            raise ValueError(f"the {runtime} runtime cannot honour: " + "; ".join(problems))

    def on_loopback(self) -> ServeConfig:
        """This config on 127.0.0.1 with free ports for the ports its runtime listens on
        (tests, benchmarks, ``servekit compare``)."""
        from .endpoints import free_port

        ports: dict[str, Any] = {
            p: free_port()
            for p in ("http_port", "grpc_port", "metrics_port")
            if p not in _UNSUPPORTED[self.runtime]
        }
        server = dataclasses.replace(self.server, host="127.0.0.1", **ports)
        return dataclasses.replace(self, server=server)

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The whole config as a file's tables (``from_dict``'s inverse)."""
        data: dict[str, Any] = {
            "runtime": self.runtime,
            "server": self.server.to_dict(),
            "models": [m.to_dict() for m in self.models],
        }
        if self.cache_dir is not None:
            data["cache_dir"] = self.cache_dir
        if self.ray != RayOptions():
            data["ray"] = self.ray.to_dict()
        if self.store.active:
            data["store"] = self.store.to_dict()
        if self.storage != StorageConfig():
            data["storage"] = self.storage.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServeConfig:
        """A config from a file's tables; an unknown key is named with its section."""
        data = dict(data)
        model_keys = {f.name for f in dataclasses.fields(ModelConfig)} | {"model"}
        top = {"runtime", "server", "models", "cache_dir", "ray", "store", "storage"}
        check_keys("top level", data, top | (model_keys if "models" not in data else set()))
        flat = {k: data.pop(k) for k in list(data) if k in model_keys}
        if "model" in flat:  # the one-model shorthand
            flat["source"] = flat.pop("model")
        if flat:
            models = [ModelConfig.from_dict(flat, "top level")]
        else:
            store_root = isinstance(data.get("store"), Mapping) and "root" in data["store"]
            raw = data.get("models", [] if store_root else [{}])
            if not isinstance(raw, Sequence) or isinstance(raw, str):
                raise ValueError(f"[[models]]: expected a list of tables, got {raw!r}")
            models = [ModelConfig.from_dict(m, f"models.{i}") for i, m in enumerate(raw)]
        return cls(
            models=tuple(models),
            server=ServerConfig.from_dict(data.get("server", {})),
            runtime=data.get("runtime", "pytriton"),
            cache_dir=data.get("cache_dir"),
            ray=RayOptions.from_dict(data.get("ray", {})),
            store=StoreConfig.from_dict(data.get("store", {})),
            storage=StorageConfig.from_dict(data.get("storage", {})),
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ServeConfig:
        """Read a ``.toml`` / ``.yaml`` file; errors name the file and the bad key."""
        try:
            return cls.from_dict(load_config(path))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_toml(self) -> str:
        """The config as a TOML file that ``ServeConfig.load`` reads back equal."""
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    def with_overrides(
        self,
        *,
        models: Sequence[str] = (),
        server: Mapping[str, Any] | None = None,
        model: Mapping[str, Any] | None = None,
        batching: Mapping[str, Any] | None = None,
        queue: Mapping[str, Any] | None = None,
        runtime: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
    ) -> ServeConfig:
        """This config with command-line flags applied: ``models`` (sources) replace the
        file's models, keeping the first one's settings; the rest override every model's
        (``model``: ``ModelConfig`` fields, ``batching``/``queue``: the policy's), or the
        server's. None values are flags not given."""

        def given(d: Mapping[str, Any] | None) -> dict[str, Any]:
            return {k: v for k, v in (d or {}).items() if v is not None}

        base = self.models
        if models:
            first = dataclasses.replace(base[0], name="")
            base = tuple(dataclasses.replace(first, source=os.fspath(s), name="") for s in models)
        model_changes, batch_changes, queue_changes = given(model), given(batching), given(queue)
        if "name" in model_changes and len(base) > 1:
            raise ValueError("--name applies to one model; give it in the config file instead")
        out = []
        for m in base:
            policy = m.batching
            if batch_changes or queue_changes:
                table = policy.to_dict()
                table.update(batch_changes)
                table["queue"] = {**table["queue"], **queue_changes}
                policy = BatchingPolicy.from_dict(table)
            out.append(dataclasses.replace(m, **model_changes, batching=policy))
        return dataclasses.replace(
            self,
            models=tuple(out),
            server=dataclasses.replace(self.server, **given(server)),
            runtime=runtime or self.runtime,
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else self.cache_dir,
        )


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's tables, unchecked (``ServeConfig.load`` checks them)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"{path}: YAML needs PyYAML (pip install pyyaml), or use TOML"
            ) from None
        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        raise ValueError(f"{path}: config files must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table of settings, got {type(data).__name__}")
    return data
