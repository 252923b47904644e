"""``servekit optimize``: an ONNX model at lower precision, calibrated through servekit's stages.

INT8 is static quantisation in ONNX Runtime's QDQ format with per-channel symmetric INT8
weights. Activations depend on the target: ``tensorrt`` makes them symmetric INT8 (zero
point 0), the explicitly quantised graph TensorRT reads, and which ONNX Runtime also
runs, correctly but here no faster than FP32; ``cpu`` (the default) makes them
asymmetric UINT8, which ONNX Runtime's x86 kernels (VNNI/AMX) run fast. Calibration images go through the
same ``Preprocess`` the model serves with (its scaling from the model's metadata), so the
ranges match what the model sees in production. FP16 converts weights and activations,
keeping FP32 inputs and outputs, which pays on GPUs; ONNX Runtime's CPU provider has no
BF16 convolutions, so BF16 belongs to the Torch and TensorRT runners.

``fold_pixels`` folds the preprocessing's last steps into the graph: the model then takes
the decoded, cropped image as UINT8 NHWC pixels (a quarter of FP32's bytes) and scales
and transposes them where it runs, on the GPU when the engine is there.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from .config import PRECISIONS

__all__ = [
    "CALIBRATION_METHODS",
    "PIXELS",
    "PRECISIONS",
    "TARGETS",
    "calibration_images",
    "fold_pixels",
    "optimize",
]

CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
TARGETS = ("cpu", "tensorrt")
PIXELS = "pixels"
"""The input a model with its preprocessing folded in takes: UINT8 [N,S,S,3] RGB."""


def calibration_images(
    directory: str | os.PathLike[str] | None = None, samples: int = 32
) -> list[bytes]:
    """Encoded images for calibration: up to ``samples`` files from ``directory`` (sorted),
    or ``samples`` generated ones when no directory is given."""
    from .stages import IMAGE_SUFFIXES, synthetic_image

    if directory is None:
        return [synthetic_image(1000 + i) for i in range(samples)]
    files = sorted(p for p in Path(directory).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)[
        :samples
    ]
    if not files:
        raise ValueError(f"calibration: no images under {directory}")
    return [p.read_bytes() for p in files]


class _Reader:
    """ONNX Runtime's CalibrationDataReader over preprocessed image batches."""

    def __init__(self, batches: Iterator[dict[str, np.ndarray]]) -> None:
        self._batches = batches

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._batches, None)


def optimize(
    model: str | os.PathLike[str],
    precision: str,
    *,
    output: str | os.PathLike[str] | None = None,
    images: Sequence[bytes] | None = None,
    method: str = "minmax",
    per_channel: bool = True,
    target: str = "cpu",
    sensitivity: float | None = 4.0,
    keep_fp32: Sequence[str] = (),
    batch_size: int = 8,
    pixels: bool = False,
) -> Path:
    """Write ``model`` at ``precision`` to ``output`` (default ``<model>.<precision>.onnx``,
    ``<model>.<precision>.pixels.onnx`` with ``pixels``); the model's metadata (labels,
    input scaling) is kept. ``pixels``: then fold the input scaling in (``fold_pixels``).

    Args:
        images: encoded calibration images (INT8); default 32 generated ones.
        method: INT8 calibration: ``minmax``, ``entropy`` or ``percentile`` (99.999).
        target: INT8 activations for ``cpu`` (UINT8) or ``tensorrt`` (symmetric INT8).
        sensitivity: INT8 keeps in FP32 the outlier layers: every Conv/Gemm whose weights,
            quantised alone, move the logits (mean relative error over up to 8
            calibration images) by more than ``sensitivity`` times the median layer's;
            ``None`` quantises every layer.
        keep_fp32: node names to keep in FP32 as well.
    """
    src = Path(model)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if method not in CALIBRATION_METHODS:
        raise ValueError(f"calibration method must be one of {CALIBRATION_METHODS}, got {method!r}")
    suffix = f"{precision}.pixels" if pixels else precision
    dst = Path(output) if output else src.with_name(f"{src.stem}.{suffix}.onnx")
    if precision == "fp32":
        dst.write_bytes(src.read_bytes())
    elif precision == "bf16":
        raise ValueError(
            "bf16: ONNX Runtime's CPU provider has no BF16 convolutions; "
            "use fp16 for ONNX on GPUs, or BF16 in the Torch/TensorRT runners"
        )
    elif precision == "fp16":
        _fp16(src, dst)
    else:
        _int8(
            src,
            dst,
            images or calibration_images(),
            method,
            per_channel,
            target,
            sensitivity,
            tuple(keep_fp32),
        )
    _keep_metadata(src, dst)
    if pixels:
        fold_pixels(dst, output=dst)
    return dst


def fold_pixels(
    model: str | os.PathLike[str], *, output: str | os.PathLike[str] | None = None
) -> Path:
    """Write ``model``, an image classifier (FP32 input [N,3,S,S]), taking ``pixels``:
    UINT8 [N,S,S,3] RGB, the decoded and centre-cropped image (``decode_image``). The
    graph casts, transposes to NCHW and scales by the model's mean and std
    (``input_scaling``) before its first layer, exactly as ``Preprocess`` does on the host.
    Default output: ``<model>.pixels.onnx``.

    Raises:
        ValueError: the model is not one FP32 [N,3,S,S] input, or already takes pixels.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from .stages import input_scaling, pixel_scaling

    src = Path(model)
    dst = Path(output) if output else src.with_name(f"{src.stem}.pixels.onnx")
    proto = onnx.load(str(src))
    graph = proto.graph
    weights = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in weights]
    if len(inputs) != 1:
        raise ValueError(f"fold_pixels: {src} has {len(inputs)} inputs; an image classifier has 1")
    x = inputs[0]
    kind = x.type.tensor_type
    dims = [d.dim_value or d.dim_param or "?" for d in kind.shape.dim]
    if (
        kind.elem_type != TensorProto.FLOAT
        or len(dims) != 4
        or dims[1] != 3
        or not isinstance(dims[2], int)
        or dims[2] != dims[3]
    ):
        got = f"{TensorProto.DataType.Name(kind.elem_type)} {dims}"
        raise ValueError(
            f"fold_pixels: input {x.name!r} of {src}: expected FLOAT [N,3,S,S], got {got}"
        )
    if PIXELS in {x.name, *weights, *(n for node in graph.node for n in node.output)}:
        raise ValueError(f"fold_pixels: {src} already has a tensor named {PIXELS!r}")
    meta = {p.key: p.value for p in proto.metadata_props}
    scale, shift = (v.reshape(1, 3, 1, 1) for v in pixel_scaling(*input_scaling(meta)))
    side = dims[2]
    names = [f"servekit_pixels_{step}" for step in ("float", "nchw", "scaled")]
    prefix = [
        helper.make_node("Cast", [PIXELS], [names[0]], names[0], to=TensorProto.FLOAT),
        helper.make_node("Transpose", [names[0]], [names[1]], names[1], perm=[0, 3, 1, 2]),
        helper.make_node("Mul", [names[1], "servekit_pixels_scale"], [names[2]], names[2]),
        helper.make_node("Add", [names[2], "servekit_pixels_shift"], [x.name], x.name + "_in"),
    ]
    graph.initializer.extend(
        [
            numpy_helper.from_array(scale, "servekit_pixels_scale"),
            numpy_helper.from_array(shift, "servekit_pixels_shift"),
        ]
    )
    batch = dims[0] if dims[0] != "?" else "batch"
    pixels = helper.make_tensor_value_info(PIXELS, TensorProto.UINT8, [batch, side, side, 3])
    position = list(graph.input).index(x)
    graph.input.remove(x)
    graph.input.insert(position, pixels)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(prefix + nodes)
    onnx.helper.set_model_props(proto, {**meta, "servekit.pixels": "uint8 NHWC RGB"})
    onnx.checker.check_model(proto)
    onnx.save(proto, str(dst))
    return dst


def sensitive_layers(model: Path, input_name: str, x: np.ndarray) -> list[tuple[str, float]]:
    """Each Conv/Gemm with the mean relative logit error that quantising its weights
    alone (per-channel symmetric INT8) causes on ``x``, most sensitive first."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    base = onnx.load(str(model))

    def logits(m: onnx.ModelProto) -> np.ndarray:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(
            m.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return np.asarray(session.run(None, {input_name: x})[0], dtype=np.float64)

    ref = logits(base)
    scale = np.maximum(np.abs(ref).max(axis=1), 1e-12)
    index = {t.name: i for i, t in enumerate(base.graph.initializer)}
    out = []
    for node in base.graph.node:
        if node.op_type not in ("Conv", "Gemm") or node.input[1] not in index:
            continue
        i = index[node.input[1]]
        original = base.graph.initializer[i]
        w = numpy_helper.to_array(original)
        step = np.abs(w).max(axis=tuple(range(1, w.ndim)), keepdims=True) / 127.0
        step[step == 0] = 1.0
        fake = (np.clip(np.round(w / step), -127, 127) * step).astype(w.dtype)
        saved = onnx.TensorProto()
        saved.CopyFrom(original)
        original.CopyFrom(numpy_helper.from_array(fake, original.name))
        err = float((np.abs(logits(base) - ref).max(axis=1) / scale).mean())
        original.CopyFrom(saved)
        out.append((node.name, err))
    return sorted(out, key=lambda item: -item[1])


def _keep_metadata(src: Path, dst: Path) -> None:
    import onnx

    props = {p.key: p.value for p in onnx.load(str(src), load_external_data=False).metadata_props}
    if not props:
        return
    model = onnx.load(str(dst))
    merged = {p.key: p.value for p in model.metadata_props} | props
    onnx.helper.set_model_props(model, merged)
    onnx.save(model, str(dst))


def _fp16(src: Path, dst: Path) -> None:
    import onnx

    try:
        from onnxconverter_common import float16
    except ImportError:
        raise ImportError(
            "fp16 needs onnxconverter-common: pip install 'servekit[optimize]'"
        ) from None
    converted = float16.convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    onnx.save(converted, str(dst))


def _int8(
    src: Path,
    dst: Path,
    images: Sequence[bytes],
    method: str,
    per_channel: bool,
    target: str,
    sensitivity: float | None,
    keep_fp32: tuple[str, ...],
) -> None:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from .pipeline import image_classifier
    from .runners.onnx import OnnxRuntimeRunner

    runner = OnnxRuntimeRunner(src, intra_op_threads=1)
    try:
        clf = image_classifier(runner)
        pre, name = clf.steps[0], runner.spec.inputs[0].name
        # One image per calibration step: the histogram methods need equal shapes.
        tensors = [pre.images([image]) for image in images]  # type: ignore[attr-defined]
    finally:
        runner.close()
    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    with tempfile.TemporaryDirectory(prefix="servekit-quant-") as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        exclude = list(keep_fp32)
        if sensitivity is not None:
            probe = np.concatenate(tensors[:8])
            layers = sensitive_layers(prepared, name, probe)
            limit = sensitivity * float(np.median([err for _, err in layers]))
            exclude += [n for n, err in layers if err > limit]
        quantize_static(
            str(prepared),
            str(dst),
            _Reader(iter({name: t} for t in tensors)),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QInt8 if target == "tensorrt" else QuantType.QUInt8,
            # ONNX Runtime's UINT8 x INT8 kernels on x86 CPUs without VNNI (AVX2 alone)
            # multiply through 16-bit sums that saturate; UINT8 x UINT8 never does, so a
            # file made for the CPU answers the same on every CPU it is served on.
            weight_type=QuantType.QInt8 if target == "tensorrt" else QuantType.QUInt8,
            per_channel=per_channel,
            calibrate_method=methods[method],
            nodes_to_exclude=sorted(set(exclude)),
            extra_options={
                # Zero points of 0: what TensorRT's explicit quantisation accepts.
                "ActivationSymmetric": target == "tensorrt",
                "WeightSymmetric": True,
            },
        )
