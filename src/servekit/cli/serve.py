"""``servekit serve`` (any runtime, from a ``ServeConfig``) and ``servekit triton`` (tritonserver
on a repository of your own); both run under the ``Supervisor``."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Annotated, Any

import typer

from ..config import ServeConfig
from ..config.server import ray_port_count
from ..errors import ServekitError
from .common import (
    CacheDir,
    ConfigFile,
    Delay,
    Engine,
    Front,
    GcsEndpoint,
    Instances,
    Labels,
    MaxBatch,
    Models,
    Name,
    Precision,
    Preferred,
    QueueSize,
    S3Endpoint,
    Threads,
    TopK,
    console,
    fail,
    serve_config,
)

__all__ = ["serve", "triton"]

SERVER_FLAGS = (
    "host",
    "http_port",
    "grpc_port",
    "metrics_port",
    "triton_http_port",
    "triton_grpc_port",
    "triton_metrics_port",
    "front",
    "inference_token",
    "control_token",
    "log_verbose",
)
"""The flags of both commands that set ``ServeConfig.server`` fields of the same names."""


PORTS = ("http_port", "grpc_port", "metrics_port",
         "triton_http_port", "triton_grpc_port", "triton_metrics_port")  # fmt: skip
"""The ports ``--port-base N`` sets, N, N+1, ... in this order."""


def _server_flags(scope: dict[str, object]) -> dict[str, object]:
    """The server flags given, by field name (None: not given)."""
    return {name: scope[name] for name in SERVER_FLAGS}


def _from_port_base(cfg: ServeConfig, base: int | None, flags: dict[str, object]) -> ServeConfig:
    """With ``--port-base``: every port ``cfg``'s runtime opens that no flag names, from
    ``base`` in ``PORTS``' order, and the ports of a Ray the ray runtime starts after them
    (``[ray] ports``, unless the file gives them)."""
    if base is None:
        return cfg
    public = ("http_port",) if cfg.runtime == "ray" else ("http_port", "grpc_port", "metrics_port")
    opened = [*public, *cfg.private_ports()]
    chosen: dict[str, Any] = {
        name: base + offset
        for offset, name in enumerate(PORTS)
        if name in opened and flags[name] is None
    }
    try:
        cfg = cfg.replace(server=dataclasses.replace(cfg.server, **chosen))
        if cfg.runtime == "ray" and not cfg.ray.address and not cfg.ray.ports:
            first = base + len(PORTS)
            ports = tuple(range(first, first + ray_port_count()))
            cfg = cfg.replace(ray=dataclasses.replace(cfg.ray, ports=ports))
        return cfg.check()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--port-base") from None


TritonPort = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=65535,
        help="Behind the front (pytriton, triton): this tritonserver port, on 127.0.0.1 "
        "(default: a free one, announced at start).",
    ),
]
PortBase = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=65530,
        help="Every port from N: HTTP N, gRPC N+1, metrics N+2, tritonserver's own "
        "behind the front N+3, N+4, N+5, and the ray runtime's own Ray from N+6 (its "
        f"GCS, agents and worker processes: {ray_port_count()} ports here) (a port flag "
        "given wins; the startup line lists every port).",
    ),
]


Restarts = Annotated[
    int,
    typer.Option(
        min=0,
        help="Restart a runtime that dies, up to N times in 10 minutes, each restart after "
        "the first waiting twice as long (1 s, 2 s, ...; 0 = never restart).",
    ),
]
InferenceToken = Annotated[
    str | None,
    typer.Option(
        envvar="SERVEKIT_INFERENCE_TOKEN",
        help="Require this servekit-inference-token header on inference.",
    ),
]
ControlToken = Annotated[
    str | None,
    typer.Option(
        envvar="SERVEKIT_CONTROL_TOKEN",
        help="Require this token on Triton's control APIs (servekit-control-token; "
        "PyTriton: its access token).",
    ),
]


def serve(
    config: ConfigFile = None,
    model: Models = None,
    runtime: Annotated[
        str | None, typer.Option(help="pytriton (default), triton, native or ray.")
    ] = None,
    name: Name = None,
    engine: Engine = None,
    precision: Precision = None,
    instances: Instances = None,
    threads: Threads = None,
    max_batch_size: MaxBatch = None,
    preferred_batch_sizes: Preferred = None,
    max_queue_delay_us: Delay = None,
    max_queue_size: QueueSize = None,
    top_k: TopK = None,
    labels: Labels = None,
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    http_port: Annotated[int | None, typer.Option()] = None,
    grpc_port: Annotated[int | None, typer.Option()] = None,
    metrics_port: Annotated[int | None, typer.Option()] = None,
    triton_http_port: TritonPort = None,
    triton_grpc_port: TritonPort = None,
    triton_metrics_port: TritonPort = None,
    port_base: PortBase = None,
    front: Front = None,
    inference_token: InferenceToken = None,
    control_token: ControlToken = None,
    log_verbose: Annotated[int | None, typer.Option(help="Triton's --log-verbose level.")] = None,
    restarts: Restarts = 5,
    cache_dir: CacheDir = None,
    s3_endpoint_url: S3Endpoint = None,
    gcs_endpoint_url: GcsEndpoint = None,
    address: Annotated[
        str | None,
        typer.Option(
            help="With --runtime ray: the Ray cluster to deploy on (its head's host:port, "
            "or auto); without it servekit starts a Ray of its own."
        ),
    ] = None,
) -> None:
    """Serve models over KServe v2 (HTTP, and gRPC on every runtime but ray): each tensor
    model and, for image classifiers, <name>_image (images in, top-k out). SIGHUP reloads
    the model files and the config file's traffic splits; SIGINT/SIGTERM stop."""
    from ..serving import serve as run
    from ..triton.env import TritonSetupError

    flags = _server_flags(locals())

    def read() -> ServeConfig:  # again on SIGHUP: the file's traffic splits
        cfg = serve_config(
            config,
            models=model,
            runtime=runtime,
            cache_dir=cache_dir,
            server=flags,
            name=name,
            engine=engine,
            precision=precision,
            instances=instances,
            threads=threads,
            top_k=top_k,
            labels=labels,
            max_batch_size=max_batch_size,
            preferred_batch_sizes=preferred_batch_sizes,
            max_queue_delay_us=max_queue_delay_us,
            max_queue_size=max_queue_size,
            s3_endpoint_url=s3_endpoint_url,
            gcs_endpoint_url=gcs_endpoint_url,
        )
        if address is not None:
            if cfg.runtime != "ray":
                raise typer.BadParameter(
                    f"is Ray's: it needs --runtime ray, not {cfg.runtime}", param_hint="--address"
                )
            try:
                cfg = cfg.replace(ray=dataclasses.replace(cfg.ray, address=address))
            except ValueError as exc:  # the file's [ray] ports are not the cluster's
                raise typer.BadParameter(str(exc), param_hint="--address") from None
        return _from_port_base(cfg, port_base, flags)

    cfg = read()
    try:  # every port known before the start, and the same ones on a reread
        cfg = cfg.private_ports_chosen()
    except OSError as exc:
        raise fail(str(exc)) from None
    flags.update(cfg.private_ports())
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    console.print(
        f"starting the {cfg.runtime} runtime with {[m.name for m in cfg.models]} on "
        f"{cfg.listening()}; ready once every model is loaded"
    )
    try:
        code = run(
            cfg,
            max_restarts=restarts,
            on_event=console.print,
            reread=read if config is not None else None,
        )
    except TritonSetupError as exc:
        raise fail(f"cannot start Triton: {exc}", 3) from None
    except ImportError as exc:
        raise fail(f"the {cfg.runtime} runtime is not installed: {exc}", 3) from None
    except (ValueError, OSError, ServekitError) as exc:
        raise fail(str(exc)) from None
    raise typer.Exit(code)


def triton(
    ctx: typer.Context,
    model_repository: Annotated[
        Path, typer.Option(help="Triton model repository.", exists=True, file_okay=False)
    ],
    model_control_mode: Annotated[
        str, typer.Option(help="none, poll or explicit (Triton's).")
    ] = "none",
    repository_poll_secs: Annotated[int, typer.Option(min=1)] = 5,
    load_model: Annotated[
        list[str] | None, typer.Option(help="With explicit: model to load at start.")
    ] = None,
    config: ConfigFile = None,
    host: Annotated[str | None, typer.Option()] = None,
    http_port: Annotated[int | None, typer.Option()] = None,
    grpc_port: Annotated[int | None, typer.Option()] = None,
    metrics_port: Annotated[int | None, typer.Option()] = None,
    triton_http_port: TritonPort = None,
    triton_grpc_port: TritonPort = None,
    triton_metrics_port: TritonPort = None,
    port_base: PortBase = None,
    log_verbose: Annotated[int | None, typer.Option()] = None,
    restarts: Restarts = 5,
    inference_token: InferenceToken = None,
    control_token: ControlToken = None,
    front: Front = None,
) -> None:
    """Run the tritonserver bundled with PyTriton on a repository, with the servekit backend
    installed and the environment fixed (the server section of --config applies). Other
    tritonserver flags pass through, e.g.
    `servekit triton --model-repository model_repository -- --strict-readiness=false`."""
    from ..runtime import Supervisor
    from ..triton.env import TritonSetupError
    from ..triton.launcher import TritonOptions, TritonProcess

    flags = _server_flags(locals())
    cfg = _from_port_base(serve_config(config, runtime="triton", server=flags), port_base, flags)
    try:
        cfg = cfg.private_ports_chosen()
    except OSError as exc:
        raise fail(str(exc)) from None
    try:
        options = TritonOptions(
            model_repository,
            cfg.server,
            model_control_mode=model_control_mode,
            repository_poll_secs=repository_poll_secs,
            load_models=tuple(load_model or ()),
            extra_args=tuple(ctx.args),
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    process = TritonProcess(options, autoscale=cfg.autoscale_policies())
    console.print(f"starting tritonserver on {cfg.listening()}")
    try:
        code = Supervisor(process, max_restarts=restarts, on_event=console.print).run()
    except TritonSetupError as exc:
        raise fail(f"cannot start Triton: {exc}", 3) from None
    raise typer.Exit(code)
