"""``ServeConfig``: the whole service, what each runtime can honour of it (``check``), and
how it is read from a file (``load_config``, the legacy one-model format) and flags."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..autoscale import AutoscalePolicy
from ..batching.policy import BatchingPolicy
from ..endpoints import PortRange, said_ports
from ..storage import StorageConfig
from ..tables import check_keys
from .model import ModelConfig
from .names import RUNTIMES, image_model_name, version_model_name
from .server import RAY_PORTS, RayOptions, ServerConfig, StoreConfig, ray_port_count

__all__ = ["ServeConfig", "load_config"]


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
        "max_sequence_replay": "a sequence lives in servekit's front, which replays nothing",
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
        "max_sequence_replay": _IN_PROCESS,
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
        "max_sequence_replay": "a sequence lives in the ingress replica, which replays nothing",
    },
}


_DIRECT_HONOURS = ("keep_alive_s", "max_connections")
"""What Ray's ingress honours with ``[ray] direct``: it is then servekit's HTTP server."""


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
        for m in self.models:
            if m.source and m.version_policy != "latest":
                raise ValueError(
                    f"model {m.name!r}: version_policy chooses among a [store] root's version "
                    f"folders; leave out source ({m.source!r}) to serve the stored model"
                )
            if not m.source and not m.steps and self.store.root is None:
                raise ValueError(f"model {m.name!r} has no source, and no [store] root holds it")
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
            elif runtime == "ray" and self.ray.direct and knob in _DIRECT_HONOURS:
                continue
            elif getattr(self.server, knob) != getattr(default_server, knob):
                problems.append(f"server.{knob} = {getattr(self.server, knob)!r} ({why})")
        problems += [
            f"models.{m.name}: version = {m.version} (the number a [store] root's Triton "
            "layout gives a model's folder; versions beside it go in [[models.versions]])"
            for m in self.models
            if m.version != 1
        ]
        if runtime == "pytriton" and not self.server.front:
            problems += [
                f"models.{m.name}: [models.sequence_batching] with server.front = false "
                "(PyTriton has no sequence batcher: servekit's front runs it)"
                for m in self.models
                if m.sequence_batching is not None
            ]
        if runtime == "ray" and self.ray.ingress_replicas > 1:
            problems += [
                f"models.{m.name}: [models.sequence_batching] with [ray] ingress_replicas = "
                f"{self.ray.ingress_replicas} (a sequence's state lives in one ingress "
                "replica, which every request of it must reach)"
                for m in self.models
                if m.sequence_batching is not None
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
        if runtime == "ray" and self.store.active and self.ray.direct:
            problems.append(
                "[ray] direct with a [store] (the store starts its models on the loop Ray's "
                "proxy calls the ingress on; serve a store through Ray's proxy)"
            )
        if runtime == "ray" and self.store.active and self.ray.ingress_replicas > 1:
            problems.append(
                f"[ray] ingress_replicas = {self.ray.ingress_replicas} with a [store] (the "
                "store lives in one ingress replica, so that every host sees one index, "
                "budget and load)"
            )
        stages_apart = {
            "triton": "the ensemble runs <name>_preprocess as a model of its own",
            "ray": "without [ray] fuse the stages run in replicas of their own",
        }
        if runtime in stages_apart and not (runtime == "ray" and self.ray.fuse):
            problems += [
                f"models.{m.name}: image_decode = {m.image_decode!r} (the images decode "
                f"beside the model only in its process: {stages_apart[runtime]})"
                for m in self.models
                if m.image and m.image_decode not in ("auto", "host")
            ]
        problems += _cache_problems(self, runtime)
        if problems:
            raise ValueError(f"the {runtime} runtime cannot honour: " + "; ".join(problems))

    def on_loopback(self, within: PortRange | None = None) -> ServeConfig:
        """This config on 127.0.0.1 with free ports for every port its runtime listens on
        (tests, benchmarks, ``servekit compare``), all ``within`` a range where one is given
        (then the Ray the ray runtime starts gets its ports there too: ``[ray] ports``).

        Raises:
            OSError: the range has too few free ports.
        """
        from ..endpoints import free_port

        ports: dict[str, Any] = {
            p: free_port(within)
            for p in ("http_port", "grpc_port", "metrics_port")
            if p not in _UNSUPPORTED[self.runtime]
        }
        server = dataclasses.replace(self.server, host="127.0.0.1", **ports)
        ray = self.ray
        if self.runtime == "ray" and within is not None and not ray.address and not ray.ports:
            chosen = tuple(free_port(within) for _ in range(ray_port_count()))
            ray = dataclasses.replace(ray, ports=chosen)  # Ray's own, in the range too
        return dataclasses.replace(self, server=server, ray=ray).private_ports_chosen(within)

    def private_ports(self) -> dict[str, int]:
        """tritonserver's own ports behind servekit's front (pytriton and triton with
        ``server.front``), by name; 0 where none is chosen yet. Empty on other runtimes."""
        if self.runtime not in ("pytriton", "triton") or not self.server.front:
            return {}
        s = self.server
        return {"triton_http_port": s.triton_http_port, "triton_grpc_port": s.triton_grpc_port,
                "triton_metrics_port": s.triton_metrics_port}  # fmt: skip

    def private_ports_chosen(self, within: PortRange | None = None) -> ServeConfig:
        """This config with a free port (``within`` a range, if given) for each private port
        left to chance, so that every port is known, and announced, before the server starts."""
        from ..endpoints import free_port

        chosen: dict[str, Any] = {
            k: free_port(within) for k, v in self.private_ports().items() if not v
        }
        if not chosen:
            return self
        return dataclasses.replace(self, server=dataclasses.replace(self.server, **chosen))

    def listening(self) -> str:
        """Every port the runtime opens, as its startup line says them."""
        ray = self.runtime == "ray"  # Ray's ingress is HTTP only, its metrics on that port
        line = self.server.listening(grpc=not ray, metrics_port=not ray)
        private = self.private_ports()
        if private:
            line += (
                f"; tritonserver behind the front on 127.0.0.1: HTTP "
                f"{private['triton_http_port'] or 'any free'}, gRPC "
                f"{private['triton_grpc_port'] or 'any free'}, metrics "
                f"{private['triton_metrics_port'] or 'any free'}"
            )
        elif self.runtime in ("pytriton", "triton"):
            line += " (tritonserver itself, no front)"
        if ray and not self.ray.address:
            line += "; " + _ray_ports_said(self.ray.ports)
        return line

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
        check_keys("top level", data, top | (model_keys if "models" not in data else set()), cls)
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
            if store_root:  # a [[models]] entry that names a stored model gives its settings
                raw = [
                    {**m, "source": ""}
                    if isinstance(m, Mapping) and "name" in m and not {"source", "steps"} & set(m)
                    else m
                    for m in raw
                ]
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
        """Read a ``.toml`` / ``.yaml`` file; errors name the file and the bad key.

        Relative paths in the file are relative to the file's folder, wherever the command
        runs from (as Docker Compose and Triton's repository paths are): a model's ``path``
        and ``labels``, ``[store] root``, ``cache_dir``, ``[storage] cache``, and a
        ``source`` (of a model, a version or a step) that names a file there."""
        try:
            return cls.from_dict(anchored(load_config(path), Path(path).resolve().parent))
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
        storage: Mapping[str, Any] | None = None,
    ) -> ServeConfig:
        """This config with command-line flags applied: ``models`` (sources) replace the
        file's models, keeping the first one's settings; the rest override every model's
        (``model``: ``ModelConfig`` fields, ``batching``/``queue``: the policy's), the
        server's or the ``[storage]`` table's. None values are flags not given."""

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
            storage=dataclasses.replace(self.storage, **given(storage)),
            runtime=runtime or self.runtime,
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else self.cache_dir,
        )


def anchored(data: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` (a config file's tables) with its relative paths made relative to
    ``folder``. A ``source`` is anchored only where that file exists there: it may name a
    zoo model, a Python import (``module:attr``) or an object-store URL instead."""

    def place(value: Any) -> Any:
        if not isinstance(value, str) or not value or os.path.isabs(value) or "://" in value:
            return value
        return os.fspath(folder / value)

    def source(value: Any) -> Any:
        anchored_value = place(value)
        return (
            anchored_value
            if anchored_value is not value and os.path.exists(anchored_value)
            else value
        )

    def model(table: Any) -> Any:
        if not isinstance(table, Mapping):
            return table
        out = dict(table)
        for key in ("source", "model"):
            if key in out:
                out[key] = source(out[key])
        for key in ("path", "labels"):
            if key in out:
                out[key] = place(out[key])
        if isinstance(out.get("versions"), Sequence):
            out["versions"] = [
                {**v, "source": source(v.get("source"))} if isinstance(v, Mapping) else v
                for v in out["versions"]
            ]
        if isinstance(out.get("steps"), Sequence):
            out["steps"] = [model(step) for step in out["steps"]]
        return out

    out = model(data)  # the one-model shorthand's keys sit at the top level
    if isinstance(out.get("models"), Sequence) and not isinstance(out["models"], str):
        out["models"] = [model(m) for m in out["models"]]
    if "cache_dir" in out:
        out["cache_dir"] = place(out["cache_dir"])
    for table, key in (("store", "root"), ("storage", "cache")):
        if isinstance(out.get(table), Mapping) and key in out[table]:
            out[table] = {**out[table], key: place(out[table][key])}
    return out


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


def _cache_problems(config: ServeConfig, runtime: str) -> list[str]:
    """What a response cache asked for cannot do here, each naming the model or knob."""
    cached = [m for m in config.models if m.response_cache]
    out = []
    if runtime in ("pytriton", "triton") and not config.server.front and cached:
        out.append("response_cache with server.front = false (the Triton runtimes keep answers "
                   "in servekit's front)")  # fmt: skip
    for m in cached:
        if not config.server.cache.active:
            out.append(f"models.{m.name}: response_cache needs [server.cache] (local or redis)")
        if m.sequence_batching is not None:
            out.append(f"models.{m.name}: response_cache with sequence_batching (a sequence's "
                       "answer depends on its state, not its request alone)")  # fmt: skip
        if m.versions or m.traffic or m.canary:
            out.append(f"models.{m.name}: response_cache with versions or a traffic split "
                       "(the version answering is chosen per request)")  # fmt: skip
    if config.store.active and config.server.cache.active:
        out.append("[server.cache] with a [store] (not yet)")
    return out


def _ray_ports_said(ports: tuple[int, ...]) -> str:
    """The ports of the Ray the ray runtime starts, as its startup line says them."""
    if not ports:
        return (
            "and the Ray servekit starts listens on ports Ray picks (listed once it has "
            "started; --port-base chooses them, --address uses your cluster)"
        )
    named = ", ".join(f"{name} {port}" for name, port in zip(RAY_PORTS, ports, strict=False))
    return (
        f"the Ray servekit starts: {named}, worker processes "
        f"{said_ports(ports[len(RAY_PORTS) :])} (and Ray Serve's replicas' inter-deployment "
        "gRPC on ports the system picks: listed once they start)"
    )
