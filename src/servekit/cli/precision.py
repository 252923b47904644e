"""``servekit optimize`` and ``servekit accuracy``: other precisions, and what they cost in agreement."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import CacheDir, console, zoo_model

__all__ = ["accuracy", "optimize"]


def optimize(
    model: Annotated[str, typer.Argument(help="Zoo model or ONNX path.")],
    precision: Annotated[str, typer.Option(help="fp32, fp16, bf16 or int8.")] = "int8",
    calibration: Annotated[
        Path | None, typer.Option(help="INT8: folder of calibration images.")
    ] = None,
    calibration_samples: Annotated[
        int,
        typer.Option(min=1, help="INT8: images to calibrate on (generated without --calibration)."),
    ] = 32,
    method: Annotated[
        str, typer.Option(help="INT8 calibration: minmax, entropy, percentile.")
    ] = "minmax",
    target: Annotated[
        str, typer.Option(help="INT8 activations for cpu (UINT8) or tensorrt (INT8).")
    ] = "cpu",
    sensitivity: Annotated[
        float,
        typer.Option(help="INT8: keep layers over N x the median sensitivity in FP32 (0 = none)."),
    ] = 4.0,
    pixels: Annotated[
        bool,
        typer.Option(
            help="Fold the input scaling in: the model then takes UINT8 [N,S,S,3] pixels "
            "named 'pixels' (a quarter of FP32's bytes), scaled where it runs."
        ),
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(help="Default: MODEL.PRECISION.onnx (MODEL.PRECISION.pixels.onnx) beside it."),
    ] = None,
    cache_dir: CacheDir = None,
) -> None:
    """Write the model at another precision: INT8 (static QDQ, calibrated through servekit's
    Preprocess) or FP16; with --pixels, taking decoded UINT8 pixels."""
    from ..optimize import calibration_images
    from ..optimize import optimize as run_optimize

    path = zoo_model(model, cache_dir)
    try:
        images = (
            calibration_images(calibration, calibration_samples) if precision == "int8" else None
        )
        start = time.perf_counter()
        out = run_optimize(
            path,
            precision,
            output=output,
            images=images,
            method=method,
            target=target,
            sensitivity=sensitivity or None,
            pixels=pixels,
        )
    except (ValueError, ImportError) as exc:
        raise typer.BadParameter(str(exc)) from None
    console.print(
        f"{precision}: {out} ({out.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s)"
    )


def accuracy(
    model: Annotated[
        str, typer.Argument(help="Candidate: zoo model, ONNX path, or a precision of --reference.")
    ],
    reference: Annotated[
        str, typer.Option(help="Reference ONNX model, or fp32 (the zoo model).")
    ] = "fp32",
    base: Annotated[
        str, typer.Option(help="Zoo model the precisions refer to.")
    ] = "efficientnet_lite0",
    images: Annotated[
        Path | None, typer.Option(help="Folder of images (default: the photo set).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Compare a model with its reference on a fixed image set: top-1 agreement, top-5
    overlap, relative logit error. ``servekit accuracy int8`` quantises --base and compares
    it with its FP32 self."""
    from ..accuracy import compare_models
    from ..optimize import PRECISIONS, calibration_images
    from ..optimize import optimize as run_optimize

    ref = zoo_model(base if reference == "fp32" else reference, cache_dir)
    if model in PRECISIONS:
        out = ref.with_name(f"{ref.stem}.{model}.onnx")
        cal = calibration_images(images) if images else None
        candidate = run_optimize(ref, model, output=out, images=cal)
    else:
        candidate = zoo_model(model, cache_dir)
    blobs = calibration_images(images, samples=10_000) if images is not None else None
    report = compare_models(ref, candidate, blobs)
    if as_json:
        console.print_json(json.dumps(report.as_dict()))
        return
    table = Table("metric", "value", title=f"{report.candidate} against {report.reference}")
    for key, value in report.as_dict().items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    console.print(table)
