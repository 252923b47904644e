"""``servekit batch``: offline batch inference on Ray Data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import zoo
from .common import CacheDir, console, zoo_model

__all__ = ["batch"]


def batch(
    input_dir: Annotated[Path, typer.Argument(help="Folder of images and/or .npy tensors.")],
    output: Annotated[Path, typer.Argument(help="Folder for the Parquet predictions.")],
    model: Annotated[str, typer.Option(help="Zoo model or ONNX path.")] = "resnet50",
    top_k: Annotated[int, typer.Option(min=1)] = 5,
    labels: Annotated[Path | None, typer.Option(help="Class names, one per line.")] = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    actors: Annotated[str, typer.Option(help="Actor pool: a size, or MIN,MAX to autoscale.")] = "2",
    actor_cpus: Annotated[float, typer.Option(help="CPUs reserved per actor.")] = 0.5,
    threads: Annotated[int | None, typer.Option(min=1, help="ORT threads per actor.")] = 1,
    address: Annotated[
        str | None, typer.Option(help="An existing Ray cluster (default: a local Ray).")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUTPUT if it exists.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Offline batch inference on Ray Data: score every file under INPUT_DIR with a pool
    of actors holding servekit runners and write one Parquet row per file to OUTPUT."""
    import shutil

    from ..ray.batch import run_batch
    from ..stages.classify import load_labels

    if output.exists() and any(output.iterdir()):
        if not overwrite:
            raise typer.BadParameter(f"{output} is not empty (use --overwrite)")
        shutil.rmtree(output)
    try:
        pool = tuple(int(v) for v in actors.split(","))
        if len(pool) not in (1, 2) or min(pool) < 1:
            raise ValueError
    except ValueError:
        raise typer.BadParameter(f"--actors takes N or MIN,MAX; got {actors!r}") from None
    # A local run builds a zoo model once here; a cluster's actors build it on their nodes.
    target = str(zoo.build(model, cache_dir)) if model in zoo.MODELS and not address else model
    names = None
    if labels is not None:
        names = list(load_labels(labels, _num_classes(target, cache_dir)))
    try:
        report = run_batch(
            input_dir,
            output,
            model=target,
            top_k=top_k,
            labels=names,
            batch_size=batch_size,
            actors=pool[0] if len(pool) == 1 else (pool[0], pool[1]),
            actor_cpus=actor_cpus,
            threads=threads,
            address=address,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(
        f"{report.rows} predictions for {report.files} files ({report.failed} failed) in "
        f"{report.seconds:.1f} s ({report.files_per_s:.1f} files/s) -> {report.output}"
    )
    for node, rows in sorted(report.rows_by_node.items()):
        console.print(f"  node {node[:12]}: {rows} rows")


def _num_classes(model: str, cache_dir: Path | None) -> int:
    from ..runners.onnx import OnnxRuntimeRunner

    path = zoo_model(model, cache_dir)
    with OnnxRuntimeRunner(path, intra_op_threads=1) as runner:
        return runner.spec.outputs[0].shape[0]
