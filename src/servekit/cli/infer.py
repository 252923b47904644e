"""``servekit infer`` and ``servekit demo``: classify images in-process or on a server."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..errors import ServekitError
from .common import CacheDir, console

__all__ = ["demo", "infer"]


TRAINED = "efficientnet_lite0"
"""What ``servekit infer`` classifies with by default: a trained model with ImageNet's class names."""


def infer(
    images: Annotated[
        list[Path] | None,
        typer.Argument(help="JPEG/PNG files.", exists=True, dir_okay=False),
    ] = None,
    sample: Annotated[
        list[str] | None,
        typer.Option(
            metavar="NAME",
            help="A sample photo by name, repeatable: cat, coffee, astronaut, rocket.",
        ),
    ] = None,
    model: Annotated[
        str,
        typer.Option(
            help="Zoo model or ONNX path (in-process); with --url, the served image model."
        ),
    ] = TRAINED,
    url: Annotated[
        str | None,
        typer.Option(
            help="Send to a running server (http://host:8000 or grpc://host:8001) instead."
        ),
    ] = None,
    top_k: Annotated[int, typer.Option("--top-k", min=1)] = 5,
    labels: Annotated[Path | None, typer.Option(help="Text file, one label per line.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Classify images and print the top-k classes of each: in-process, or on a server with
    --url. The default model is a trained EfficientNet-Lite0 with ImageNet's class names."""
    from ..samples import sample as load_sample

    named: list[tuple[str, bytes]] = [(str(p), p.read_bytes()) for p in images or []]
    try:
        named += [(f"sample {name}", load_sample(name)) for name in sample or []]
    except (ValueError, ImportError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--sample") from None
    if not named:
        raise typer.BadParameter("give image files or --sample NAME (cat, coffee, ...)")
    blobs = [blob for _, blob in named]
    try:
        if url is not None:
            from ..client import Client

            remote = model if model.endswith("_image") else f"{model}_image"
            with Client(url) as client:
                results = [preds[:top_k] for preds in client.classify(blobs, model=remote)]
        else:
            from ..pipeline import image_classifier

            clf = image_classifier(model, top_k=top_k, labels=labels, cache_dir=cache_dir)
            try:
                results = clf.classify(blobs)
            finally:
                clf.close()
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    if as_json:
        out = {
            name: [{"label": r.label, "class_id": r.class_id, "score": r.score} for r in preds]
            for (name, _), preds in zip(named, results, strict=True)
        }
        typer.echo(json.dumps(out, indent=2))
        return
    for (name, _), preds in zip(named, results, strict=True):
        table = Table("rank", "class", "label", "score", title=name)
        for rank, p in enumerate(preds, 1):
            table.add_row(str(rank), str(p.class_id), p.label, f"{p.score:.4f}")
        console.print(table)


def demo(
    model: Annotated[str, typer.Option(help="Zoo model name or ONNX path.")] = "resnet50",
    cache_dir: CacheDir = None,
) -> None:
    """Classify a generated image in-process with the reference ResNet-50."""
    from ..pipeline import image_classifier
    from ..stages import synthetic_image

    with console.status(f"loading {model}"):
        clf = image_classifier(model, cache_dir=cache_dir)
        clf.warmup()
    image = synthetic_image()
    start = time.perf_counter()
    preds = clf.classify([image])[0]
    ms = (time.perf_counter() - start) * 1e3
    table = Table(
        "rank", "class", "label", "score", title=f"generated {len(image)}-byte JPEG, {ms:.1f} ms"
    )
    for rank, p in enumerate(preds, 1):
        table.add_row(str(rank), str(p.class_id), p.label, f"{p.score:.4f}")
    console.print(table)
    clf.close()
