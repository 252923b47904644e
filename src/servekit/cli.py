"""The ``servekit`` command line: build reference models, classify images, run the demo."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from . import zoo
from .errors import ServekitError

app = typer.Typer(help="servekit: serve deep-learning models in-process, on Triton and on Ray.")
models_app = typer.Typer(help="Reference models built locally from a fixed seed.")
app.add_typer(models_app, name="models")
console = Console()

CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir", help="Model cache (default $SERVEKIT_CACHE or ~/.cache/servekit/models)."
    ),
]


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


@app.command()
def infer(
    images: Annotated[
        list[Path], typer.Argument(help="JPEG/PNG files.", exists=True, dir_okay=False)
    ],
    model: Annotated[
        str, typer.Option(help="Zoo model name or path to an ONNX file.")
    ] = "resnet50",
    top_k: Annotated[int, typer.Option("--top-k", min=1)] = 5,
    labels: Annotated[Path | None, typer.Option(help="Text file, one label per line.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Classify images in-process (no server) and print the top-k classes of each."""
    from .pipeline import image_classifier

    clf = image_classifier(model, top_k=top_k, labels=labels, cache_dir=cache_dir)
    try:
        results = clf.classify([p.read_bytes() for p in images])
    except ServekitError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    finally:
        clf.close()
    if as_json:
        out = {
            str(p): [{"label": r.label, "class_id": r.class_id, "score": r.score} for r in preds]
            for p, preds in zip(images, results, strict=True)
        }
        typer.echo(json.dumps(out, indent=2))
        return
    for path, preds in zip(images, results, strict=True):
        table = Table("rank", "class", "label", "score", title=str(path))
        for rank, p in enumerate(preds, 1):
            table.add_row(str(rank), str(p.class_id), p.label, f"{p.score:.4f}")
        console.print(table)


@app.command()
def demo(
    model: Annotated[str, typer.Option(help="Zoo model name or ONNX path.")] = "resnet50",
    cache_dir: CacheDir = None,
) -> None:
    """Classify a generated image in-process with the reference ResNet-50."""
    from .pipeline import image_classifier
    from .stages import synthetic_image

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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
