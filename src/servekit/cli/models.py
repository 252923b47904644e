"""``servekit models`` (the zoo) and ``servekit repo build`` (Triton repositories from a ``ServeConfig``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .. import zoo
from .common import (
    CacheDir,
    ConfigFile,
    Delay,
    Engine,
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
    serve_config,
)

__all__ = ["models_app", "repo_app"]

models_app = typer.Typer(
    help="Reference models built locally from a fixed seed.", rich_markup_mode=None
)
repo_app = typer.Typer(
    help="Triton model repositories rendered from a ServeConfig.", rich_markup_mode=None
)


@models_app.command("build")
def models_build(
    names: Annotated[
        list[str] | None, typer.Argument(help="Zoo models to build (default: resnet50).")
    ] = None,
    cache_dir: CacheDir = None,
    force: Annotated[bool, typer.Option(help="Rebuild even when cached.")] = False,
) -> None:
    """Build zoo models into the cache (deterministic: same bytes every build)."""
    for name in names or ["resnet50"]:
        if name not in zoo.MODELS:
            raise typer.BadParameter(
                f"no zoo model {name!r}; available: {', '.join(sorted(zoo.MODELS))}"
            )
        start = time.perf_counter()
        with console.status(f"building {name}"):
            path = zoo.build(name, cache_dir, force=force)
        console.print(
            f"{name}: {path} ({path.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
        )


@models_app.command("list")
def models_list(cache_dir: CacheDir = None) -> None:
    """List zoo models and whether they are built."""
    directory = zoo.cache_dir(cache_dir)
    table = Table("name", "description", "built", title=f"cache: {directory}")
    for name, model in sorted(zoo.MODELS.items()):
        built = (directory / f"{name}.onnx").exists()
        table.add_row(name, model.description, "yes" if built else "no")
    console.print(table)


@repo_app.command("build")
def repo_build(
    directory: Annotated[Path, typer.Argument(help="Repository folder (created if missing).")],
    config: ConfigFile = None,
    model: Models = None,
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
    force: Annotated[bool, typer.Option(help="Rebuild weights that already exist.")] = False,
    cache_dir: CacheDir = None,
    s3_endpoint_url: S3Endpoint = None,
    gcs_endpoint_url: GcsEndpoint = None,
) -> None:
    """Write a Triton repository for the servekit backend: the models of --config/--model
    (and <name>_image ensembles for classifiers), or with neither the reference ResNet-50
    ensemble (preprocess, resnet50, postprocess, resnet50_ensemble); the flags mean what
    they mean for `servekit serve`."""
    from ..config import ServeConfig
    from ..triton.repo import REFERENCE, REFERENCE_NAMES, build_repository, model_repository

    reference = config is None and not model
    cfg = serve_config(
        config,
        models=model,
        runtime="triton",
        cache_dir=cache_dir,
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
        default=ServeConfig((REFERENCE,)),
        s3_endpoint_url=s3_endpoint_url,
        gcs_endpoint_url=gcs_endpoint_url,
    )
    try:
        with console.status(f"building {directory}"):
            models = model_repository(cfg, image_names=REFERENCE_NAMES if reference else None)
            written = build_repository(directory, models, force=force, cache_dir=cfg.cache_dir)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    for path in written:
        console.print(f"wrote {path}")
