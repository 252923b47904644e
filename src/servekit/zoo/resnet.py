"""ResNet-50 v1.5 built from its architecture with a fixed seed, BatchNorm folded into convs.

The weights are random but shaped like a trained network's: every conv is followed by
a per-channel affine fitted on a synthetic calibration batch so its output has zero
mean and unit variance (what a trained BatchNorm does, folded into the conv's weight
and bias), the last conv of each residual branch is damped, and the classifier is
centred, so activations stay finite and logits differ clearly between inputs.
Scale factors are rounded to 4 significant digits so BLAS rounding differences
between machines rarely change a byte.
"""

from __future__ import annotations

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view

from ._onnx import FLOAT, GraphBuilder

__all__ = ["RESNET50_PARAMS_WITH_BN", "build_resnet50"]

RESNET50_PARAMS_WITH_BN = 25_557_032
"""Parameter count of ResNet-50 with unfolded BatchNorm (gamma and beta per channel)."""

STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))
"""(bottleneck width, blocks, stride of the first block) per stage; output width is 4x."""
BRANCH_GAIN = 0.5
LOGIT_STD = 3.0


def _round_sig(x: np.ndarray, digits: int = 4) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    mag = np.where(x == 0, 1.0, 10.0 ** (np.floor(np.log10(np.abs(np.where(x == 0, 1, x))))))
    return (np.round(x / mag, digits - 1) * mag).astype(np.float32)


def _conv2d(x: np.ndarray, w: np.ndarray, stride: int, pad: int) -> np.ndarray:
    if pad:
        x = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    kh, kw = w.shape[2:]
    if kh == kw == 1:
        xs = x[:, :, ::stride, ::stride]
        return np.tensordot(w[:, :, 0, 0], xs, axes=([1], [1])).transpose(1, 0, 2, 3)
    win = sliding_window_view(x, (kh, kw), axis=(2, 3))  # type: ignore[call-overload]
    win = win[:, :, ::stride, ::stride]
    return np.tensordot(win, w, axes=([1, 4, 5], [1, 2, 3])).transpose(0, 3, 1, 2)


def _maxpool(x: np.ndarray) -> np.ndarray:
    x = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    windows = sliding_window_view(x, (3, 3), axis=(2, 3))  # type: ignore[call-overload]
    return windows[:, :, ::2, ::2].max(axis=(4, 5))


def _calibration_batch(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Blocky smooth images plus fine noise, roughly like normalised photos."""
    coarse = rng.standard_normal((n, 3, 7, 7)).astype(np.float32)
    img = np.repeat(np.repeat(coarse, size // 7, axis=2), size // 7, axis=3)
    img += 0.3 * rng.standard_normal(img.shape).astype(np.float32)
    img += rng.standard_normal((n, 3, 1, 1)).astype(np.float32) * 0.5
    return img


class _Builder:
    def __init__(self, seed: int, calibration_images: int, size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.g = GraphBuilder()
        self.x = _calibration_batch(self.rng, calibration_images, size)
        self.count = 0

    def conv(
        self,
        name: str,
        x: np.ndarray,
        src: str,
        out_ch: int,
        k: int,
        stride: int = 1,
        relu: bool = True,
        gain: float = 1.0,
    ) -> tuple[np.ndarray, str]:
        """Add conv (+ folded norm) (+ ReLU); return the calibration activations and tensor name."""
        in_ch = x.shape[1]
        w = self.rng.standard_normal((out_ch, in_ch, k, k)).astype(np.float32)
        w *= np.float32(np.sqrt(2.0 / (in_ch * k * k)))
        y = _conv2d(x, w, stride, k // 2)
        mean = y.mean(axis=(0, 2, 3), dtype=np.float64)
        std = y.std(axis=(0, 2, 3), dtype=np.float64) + 1e-5
        scale = _round_sig(gain / std)
        bias = _round_sig(-mean * scale)
        y = y * scale[None, :, None, None] + bias[None, :, None, None]
        w = w * scale[:, None, None, None]
        self.g.const(f"{name}.weight", w)
        self.g.const(f"{name}.bias", bias)
        out = self.g.node(
            "Conv",
            [src, f"{name}.weight", f"{name}.bias"],
            name,
            kernel_shape=[k, k],
            strides=[stride, stride],
            pads=[k // 2] * 4,
        )
        if relu:
            y = np.maximum(y, 0)
            out = self.g.node("Relu", [out], f"{name}.relu")
        return y, out

    def bottleneck(
        self, name: str, x: np.ndarray, src: str, width: int, stride: int
    ) -> tuple[np.ndarray, str]:
        h, t = self.conv(f"{name}.conv1", x, src, width, 1)
        h, t = self.conv(f"{name}.conv2", h, t, width, 3, stride)  # v1.5: stride on the 3x3
        h, t = self.conv(f"{name}.conv3", h, t, width * 4, 1, relu=False, gain=BRANCH_GAIN)
        if stride != 1 or x.shape[1] != width * 4:
            x, src = self.conv(f"{name}.downsample", x, src, width * 4, 1, stride, relu=False)
        y = np.maximum(h + x, 0)
        out = self.g.node("Add", [t, src], f"{name}.add")
        return y, self.g.node("Relu", [out], f"{name}.out")

    def build(self, num_classes: int) -> onnx.ModelProto:
        x, t = self.conv("conv1", self.x, "input", 64, 7, 2)
        x, t = (
            _maxpool(x),
            self.g.node(
                "MaxPool", [t], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]
            ),
        )
        for s, (width, blocks, stride) in enumerate(STAGES, start=1):
            for b in range(blocks):
                x, t = self.bottleneck(f"layer{s}.{b}", x, t, width, stride if b == 0 else 1)
        feats = x.mean(axis=(2, 3), dtype=np.float64)
        t = self.g.node("GlobalAveragePool", [t], "avgpool")
        t = self.g.node("Flatten", [t], "flatten", axis=1)
        w = self.rng.standard_normal((num_classes, feats.shape[1])) / np.sqrt(feats.shape[1])
        logits = feats @ w.T
        # Centre each class over the calibration batch, then scale to a clear spread.
        scale = LOGIT_STD / (logits - logits.mean(axis=0)).std()
        w = _round_sig(w * scale)
        bias = _round_sig(-(feats.mean(axis=0) @ w.T.astype(np.float64)))
        self.g.const("fc.weight", w)
        self.g.const("fc.bias", bias)
        self.g.node("Gemm", [t, "fc.weight", "fc.bias"], "logits", transB=1)
        return self.g.model(
            "resnet50",
            [("input", FLOAT, ["batch", 3, 224, 224])],
            [("logits", FLOAT, ["batch", num_classes])],
            doc=__doc__ or "",
        )


def build_resnet50(
    seed: int = 0, num_classes: int = 1000, calibration_images: int = 8, size: int = 224
) -> onnx.ModelProto:
    """ResNet-50 v1.5 (NCHW float32 ``input`` 224x224 -> ``logits``), deterministic for a seed."""
    return _Builder(seed, calibration_images, size).build(num_classes)
