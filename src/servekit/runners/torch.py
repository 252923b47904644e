"""PyTorch runner: the GPU path where TensorRT is absent (FP16/BF16, channels_last, CUDA graphs).

``TorchRunner`` takes a ``torch.nn.Module`` with a spec, or an ONNX file that
``onnx_module`` turns into one (the operators servekit's zoo uses: convolutions,
pooling, ReLU/Clip, Add, Flatten, Gemm), so the same ``resnet50.onnx`` that ONNX
Runtime serves runs under PyTorch with the same weights. On CUDA it captures one CUDA
graph per batch size; a request is copied into the smallest captured size that holds
it and the outputs are cut back to its rows.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..spec import ModelSpec
from .base import Arrays, BaseRunner
from .onnx import spec_from_onnx

__all__ = ["TORCH_PRECISIONS", "TorchRunner", "graph_batch_sizes", "onnx_module"]

TORCH_PRECISIONS = ("fp32", "fp16", "bf16")


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("TorchRunner needs PyTorch: pip install 'servekit[torch]'") from None
    return torch


def graph_batch_sizes(max_batch_size: int, preferred: Sequence[int] = ()) -> tuple[int, ...]:
    """Batch sizes to capture CUDA graphs for: powers of two up to ``max_batch_size``, the
    preferred sizes, and ``max_batch_size`` itself (so every batch fits one graph)."""
    if max_batch_size < 1:
        return (1,)
    sizes = {1 << i for i in range(max_batch_size.bit_length()) if 1 << i <= max_batch_size}
    sizes |= {b for b in preferred if 1 <= b <= max_batch_size}
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def onnx_module(model: str | os.PathLike[str]) -> Any:
    """A ``torch.nn.Module`` that runs an ONNX graph of the zoo's operators with its weights.

    Raises ``ValueError`` naming the first operator or attribute it does not translate.
    """
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(model)).graph
    steps: list[tuple[str, list[str], list[str], dict[str, Any]]] = []
    for node in graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type not in _OPS:
            raise ValueError(f"onnx_module: operator {node.op_type} ({node.name}) is not supported")
        pad_mode = attrs.get("auto_pad", b"NOTSET")
        attrs["auto_pad"] = pad_mode.decode() if isinstance(pad_mode, bytes) else pad_mode
        if attrs["auto_pad"] not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
            raise ValueError(f"onnx_module: {node.name}: auto_pad {attrs['auto_pad']}")
        steps.append((node.op_type, list(node.input), list(node.output), attrs))
    torch = _torch()
    F = torch.nn.functional
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in graph.initializer}
    inputs = [i.name for i in graph.input if i.name not in weights]
    outputs = [o.name for o in graph.output]

    class OnnxModule(torch.nn.Module):  # type: ignore[name-defined]  # torch imports lazily
        def __init__(self) -> None:
            super().__init__()
            self._names = {name: f"w{i}" for i, name in enumerate(weights)}
            for name, value in weights.items():
                self.register_buffer(self._names[name], value)

        def forward(self, *args: Any) -> tuple[Any, ...]:
            env: dict[str, Any] = dict(zip(inputs, args, strict=True))
            for name, key in self._names.items():
                env[name] = getattr(self, key)
            for op, ins, outs, attrs in steps:
                env[outs[0]] = _OPS[op](F, torch, [env[i] if i else None for i in ins], attrs)
            return tuple(env[o] for o in outputs)

    return OnnxModule().eval()


def _pads(
    x: Any, a: dict[str, Any], kernel: Sequence[int], fill: float = 0.0
) -> tuple[Any, list[int]]:
    """Apply ONNX padding: ``(input, symmetric pads left for the op)``. ``auto_pad`` SAME
    depends on the input size (TF's "same": the odd pixel at the end for SAME_UPPER)."""
    dims = len(kernel)
    strides = list(a.get("strides", [1] * dims))
    mode = a.get("auto_pad", "NOTSET")
    if mode == "VALID":
        return x, [0] * dims
    if mode.startswith("SAME"):
        sizes = x.shape[2:]
        total = [
            max((-(-n // s) - 1) * s + k - n, 0)
            for n, s, k in zip(sizes, strides, kernel, strict=True)
        ]
        small = [t // 2 for t in total]
        begins = (
            small if mode == "SAME_UPPER" else [t - h for t, h in zip(total, small, strict=True)]
        )
        ends = [t - b for t, b in zip(total, begins, strict=True)]
    else:
        pads = list(a.get("pads", [0] * 2 * dims))
        begins, ends = pads[:dims], pads[dims:]
    if begins == ends:
        return x, begins
    import torch

    # F.pad lists the last dim first: (left, right, top, bottom).
    flat = [p for b, e in zip(reversed(begins), reversed(ends), strict=True) for p in (b, e)]
    return torch.nn.functional.pad(x, flat, value=fill), [0] * dims


def _conv(F: Any, torch: Any, x: list[Any], a: dict[str, Any]) -> Any:
    kernel = list(a.get("kernel_shape", x[1].shape[2:]))
    inp, pads = _pads(x[0], a, kernel)
    return F.conv2d(
        inp, x[1], x[2] if len(x) > 2 else None,
        stride=list(a.get("strides", [1] * len(kernel))), padding=pads,
        dilation=list(a.get("dilations", [1] * len(kernel))), groups=int(a.get("group", 1)),
    )  # fmt: skip


def _maxpool(F: Any, torch: Any, x: list[Any], a: dict[str, Any]) -> Any:
    kernel = list(a["kernel_shape"])
    inp, pads = _pads(x[0], a, kernel, fill=float("-inf"))
    return F.max_pool2d(inp, kernel, list(a.get("strides", [1] * len(kernel))), pads)


def _avgpool(F: Any, torch: Any, x: list[Any], a: dict[str, Any]) -> Any:
    kernel = list(a["kernel_shape"])
    if a.get("auto_pad", "NOTSET") != "NOTSET" or len(set(a.get("pads", [0]))) > 1:
        raise ValueError("onnx_module: AveragePool with asymmetric or automatic pads")
    pads = list(a.get("pads", [0] * 4))[:2]
    return F.avg_pool2d(
        x[0], kernel, list(a.get("strides", [1] * len(kernel))), pads,
        count_include_pad=bool(a.get("count_include_pad", 0)),
    )  # fmt: skip


def _clip(F: Any, torch: Any, x: list[Any], a: dict[str, Any]) -> Any:
    lo: Any = x[1] if len(x) > 1 and x[1] is not None else a.get("min")
    hi: Any = x[2] if len(x) > 2 and x[2] is not None else a.get("max")
    lo = lo.item() if hasattr(lo, "item") else lo
    hi = hi.item() if hasattr(hi, "item") else hi
    return torch.clamp(x[0], lo, hi)


def _gemm(F: Any, torch: Any, x: list[Any], a: dict[str, Any]) -> Any:
    A = x[0].transpose(0, 1) if a.get("transA", 0) else x[0]
    B = x[1].transpose(0, 1) if a.get("transB", 0) else x[1]
    y = float(a.get("alpha", 1.0)) * (A @ B)
    if len(x) > 2 and x[2] is not None:
        y = y + float(a.get("beta", 1.0)) * x[2]
    return y


_OPS: dict[str, Any] = {
    "Conv": _conv,
    "MaxPool": _maxpool,
    "AveragePool": _avgpool,
    "GlobalAveragePool": lambda F, torch, x, a: x[0].mean(dim=(2, 3), keepdim=True),
    "Relu": lambda F, torch, x, a: F.relu(x[0]),
    "Sigmoid": lambda F, torch, x, a: torch.sigmoid(x[0]),
    "Clip": _clip,
    "Add": lambda F, torch, x, a: x[0] + x[1],
    "Mul": lambda F, torch, x, a: x[0] * x[1],
    "Flatten": lambda F, torch, x, a: torch.flatten(x[0], int(a.get("axis", 1))),
    "Gemm": _gemm,
    "MatMul": lambda F, torch, x, a: x[0] @ x[1],
    "Softmax": lambda F, torch, x, a: torch.softmax(x[0], int(a.get("axis", -1))),
}


class TorchRunner(BaseRunner):
    """Runs a PyTorch module (or an ONNX file via ``onnx_module``) on CPU or CUDA.

    Args:
        model: an ONNX path, or a ``torch.nn.Module`` (then ``spec`` is required).
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        precision: ``fp32``, ``fp16`` or ``bf16`` for weights and activations; inputs are
            cast on the device and outputs are returned in the spec's dtype.
        channels_last: NHWC memory format, which tensor-core convolutions prefer.
        cuda_graphs: capture one CUDA graph per size in ``graph_batch_sizes`` (CUDA only).
        preferred_batch_sizes: extra sizes to capture (the batching policy's).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        *,
        spec: ModelSpec | None = None,
        device: str = "cuda",
        precision: str = "fp16",
        channels_last: bool = True,
        cuda_graphs: bool = True,
        max_batch_size: int | None = None,
        preferred_batch_sizes: Sequence[int] = (),
    ) -> None:
        torch = _torch()
        if precision not in TORCH_PRECISIONS:
            raise ValueError(f"precision must be one of {TORCH_PRECISIONS}, got {precision!r}")
        if isinstance(model, (str, os.PathLike)):
            self.path: Path | None = Path(model)
            spec = spec or spec_from_onnx(self.path, max_batch_size)
            module = onnx_module(self.path)
        else:
            if spec is None:
                raise ValueError("TorchRunner: a torch module needs its spec")
            self.path, module = None, model
        self._spec = spec
        self.device = torch.device(device)
        self.accelerated = self.device.type != "cpu"
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"TorchRunner: device {device!r} asked for, but CUDA is unavailable")
        self.dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            precision
        ]
        self.precision = precision
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self._channels_last = channels_last
        self._module = module.to(self.device, dtype=self.dtype, memory_format=fmt).eval()
        self._torch = torch
        self._graphs: dict[int, tuple[Any, list[Any], tuple[Any, ...]]] = {}
        self._replay = threading.Lock()  # a graph's static buffers serve one batch at a time
        self.graph_sizes: tuple[int, ...] = ()
        if cuda_graphs and self.device.type == "cuda" and spec.batched:
            self.graph_sizes = graph_batch_sizes(spec.max_batch_size, preferred_batch_sizes)
            self._capture()

    def _to_device(self, a: np.ndarray) -> Any:
        t = self._torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)
        if t.is_floating_point():
            t = t.to(self.dtype)
        if self._channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=self._torch.channels_last)
        return t

    def _outputs(self, values: Sequence[Any], rows: int | None) -> Arrays:
        out = {}
        for t, value in zip(self._spec.outputs, values, strict=True):
            v = value[:rows] if rows is not None else value
            out[t.name] = v.float().cpu().numpy().astype(t.dtype.numpy, copy=False)
        return out

    def _capture(self) -> None:
        torch = self._torch
        stream = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for n in self.graph_sizes:
                static = [self._to_device(a) for a in self._spec.sample_inputs(n).values()]
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm the kernels' autotuning outside the graph
                        self._module(*static)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    result = self._module(*static)
                self._graphs[n] = (graph, static, result)

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        torch = self._torch
        ordered = [inputs[t.name] for t in self._spec.inputs]
        rows = len(ordered[0]) if self._spec.batched else None
        size = next((n for n in self.graph_sizes if rows is not None and n >= rows), None)
        with torch.inference_mode():
            if size is None:
                return self._outputs(self._module(*map(self._to_device, ordered)), None)
            graph, static, result = self._graphs[size]
            with self._replay:
                for dst, a in zip(static, ordered, strict=True):
                    dst[:rows].copy_(self._to_device(a))
                graph.replay()
                return self._outputs(result, rows)

    def close(self) -> None:
        self._graphs.clear()
        self._module = None
        if self.device.type == "cuda":
            self._torch.cuda.empty_cache()
