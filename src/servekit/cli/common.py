"""What the commands share: the console, the model and server flags, and how flags and a
config file become one ``ServeConfig`` (``servekit serve`` and ``servekit repo build`` take
the same flags with the same meaning)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ..config import RUNTIMES, ServeConfig

__all__ = ["console", "fail", "serve_config", "zoo_model"]

# Rich reads the terminal's width; with none (a pipe, CI logs) it would wrap at 80.
# Into a file or a pipe: whole lines (no wrapping), tables laid out 120 wide.
console = Console(width=None if os.isatty(1) else 120, soft_wrap=not os.isatty(1))


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` and return the Exit to raise."""
    console.print(f"[red]error:[/red] {message}")
    return typer.Exit(code)


def zoo_model(model: str | Path, cache_dir: Path | None) -> Path:
    """A zoo model's file or an existing model file; anything else is a usage error."""
    from .. import zoo
    from ..errors import ModelNotFound

    try:
        return zoo.resolve(model, cache_dir)
    except ModelNotFound as exc:
        raise typer.BadParameter(str(exc), param_hint="MODEL") from None


def model_source(model: str, cache_dir: Path | None) -> str:
    """What ``--model`` names as a ``ModelConfig.source``: your own model's import path as
    given (``module:attribute``), else ``zoo_model``'s file."""
    from ..custom import is_import_path

    return model if is_import_path(model) else str(zoo_model(model, cache_dir))


CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir", help="Model cache (default $SERVEKIT_CACHE or ~/.cache/servekit/models)."
    ),
]
S3Endpoint = Annotated[
    str | None,
    typer.Option(
        help="An S3-compatible store for s3:// models (MinIO, moto; [storage] "
        "s3_endpoint_url); default: AWS, or $AWS_ENDPOINT_URL_S3."
    ),
]
GcsEndpoint = Annotated[
    str | None,
    typer.Option(help="A GCS emulator for gs:// models ([storage] gcs_endpoint_url)."),
]
Front = Annotated[
    bool | None,
    typer.Option(
        "--front/--no-front",
        help="HTTP port served by servekit's hardened KServe front, Triton's own HTTP on "
        "loopback (default on; --no-front exposes Triton's HTTP API itself).",
    ),
]
ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config", help="ServeConfig file (.toml/.yaml); flags override it.", exists=True
    ),
]
Models = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        metavar="MODEL",
        help="Zoo model name, ONNX file or s3:// / gs:// object; repeat for several "
        "(replaces the file's).",
    ),
]
Name = Annotated[str | None, typer.Option(help="Served name (one model; default: its stem).")]
Engine = Annotated[str | None, typer.Option(help="onnxruntime, tensorrt or torch.")]
Precision = Annotated[str | None, typer.Option(help="fp32, fp16, bf16, int8 (TensorRT/Torch).")]
Instances = Annotated[
    int | None,
    typer.Option(min=1, help="Instances per model (Triton instance_group, Ray replicas)."),
]
Threads = Annotated[int | None, typer.Option(min=1, help="ONNX Runtime threads per instance.")]
MaxBatch = Annotated[int | None, typer.Option(min=1, help="Default: the model's own.")]
Preferred = Annotated[str | None, typer.Option(help="Preferred batch sizes, e.g. 4,8.")]
Delay = Annotated[int | None, typer.Option(min=0, help="Max queue delay in microseconds.")]
QueueSize = Annotated[
    int | None, typer.Option(min=0, help="Requests queued at most; 0 = unbounded.")
]
TopK = Annotated[int | None, typer.Option("--top-k", min=1, help="Answers of the image model.")]
Labels = Annotated[
    Path | None, typer.Option(help="Class names, one per line, for the image model.")
]


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise typer.BadParameter(
            f"expected comma-separated integers, got {text!r}", param_hint="--preferred-batch-sizes"
        ) from None


def serve_config(
    config: Path | None,
    *,
    models: list[str] | None = None,
    runtime: str | None = None,
    cache_dir: Path | None = None,
    server: dict[str, Any] | None = None,
    name: str | None = None,
    engine: str | None = None,
    precision: str | None = None,
    instances: int | None = None,
    threads: int | None = None,
    top_k: int | None = None,
    labels: Path | None = None,
    max_batch_size: int | None = None,
    preferred_batch_sizes: str | None = None,
    max_queue_delay_us: int | None = None,
    max_queue_size: int | None = None,
    default: ServeConfig | None = None,
    s3_endpoint_url: str | None = None,
    gcs_endpoint_url: str | None = None,
) -> ServeConfig:
    """The ``ServeConfig`` a config file (or the defaults) and the flags given describe,
    checked for its runtime (``default``: what to start from without a file); a bad value
    is a usage error naming it."""
    if runtime is not None and runtime not in RUNTIMES:
        raise typer.BadParameter(
            f"must be one of {list(RUNTIMES)}, got {runtime!r}", param_hint="--runtime"
        )
    try:
        base = ServeConfig.load(config) if config else default or ServeConfig()
        return base.with_overrides(
            models=models or (),
            runtime=runtime,
            cache_dir=cache_dir,
            server=server,
            model={
                "name": name,
                "engine": engine,
                "precision": precision,
                "instances": instances,
                "threads": threads,
                "top_k": top_k,
                "labels": os.fspath(labels) if labels else None,
            },
            batching={
                "max_batch_size": max_batch_size,
                "preferred_batch_sizes": _sizes(preferred_batch_sizes),
                "max_queue_delay_us": max_queue_delay_us,
            },
            queue={"max_queue_size": max_queue_size},
            storage={"s3_endpoint_url": s3_endpoint_url, "gcs_endpoint_url": gcs_endpoint_url},
        ).check()
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
