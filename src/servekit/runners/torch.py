"""PyTorch runner: the GPU path where TensorRT is absent (FP16/BF16, channels_last, CUDA graphs).

``TorchRunner`` takes a ``torch.nn.Module`` with a spec, or an ONNX file that
``onnx_module`` turns into one (the operators servekit's zoo uses: convolutions,
pooling, ReLU/Clip, Add, Flatten, Gemm, and the Cast and Transpose ``fold_pixels``
writes), so the same ``resnet50.onnx`` that ONNX Runtime serves runs under PyTorch with
the same weights. On CUDA it captures one CUDA
graph per batch size (for a model whose non-batch dimensions are all fixed); a request is
copied into the smallest captured size that holds it and the outputs are cut back to its
rows. Every CUDA call follows ``servekit.cuda``'s contract (its lanes' own non-blocking
streams, inputs made on another stream waited on and held, capture in ``thread_local``
mode).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import numpy as np

from ..cuda import Cuda, for_device
from ..device import DeviceTensor, torch_dtype, unwrap
from ..spec import ModelSpec
from .base import Arrays, BaseRunner
from .lanes import Lanes
from .onnx import spec_from_onnx
from .staging import StagingPool

__all__ = [
    "TORCH_PRECISIONS",
    "TorchRunner",
    "graph_batch_sizes",
    "onnx_module",
    "serving_backends",
]

TORCH_PRECISIONS = ("fp32", "fp16", "bf16")

log = logging.getLogger(__name__)


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("TorchRunner needs PyTorch: pip install 'servekit[torch]'") from None
    return torch


def serving_backends(torch: Any) -> None:
    """The process's cuDNN and TF32 settings under which servekit serves on CUDA (and
    ``bench/gpu.py`` measures): cuDNN picks its fastest kernels per shape (graphs hold fixed
    shapes); fp32 stays fp32 (no TF32)."""
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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
        if node.op_type == "Cast" and attrs.get("to") != onnx.TensorProto.FLOAT:
            raise ValueError(f"onnx_module: {node.name}: Cast to other than FLOAT")
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
                if op == "Cast":  # to FLOAT: the weights' own precision (the runner's)
                    env[outs[0]] = env[ins[0]].to(self._floating())
                    continue
                env[outs[0]] = _OPS[op](F, torch, [env[i] if i else None for i in ins], attrs)
            return tuple(env[o] for o in outputs)

        def _floating(self) -> Any:
            return next((b.dtype for b in self.buffers() if b.is_floating_point()), torch.float32)

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
    "Transpose": lambda F, torch, x, a: x[0].permute(*a["perm"]),
    "Cast": None,  # in forward: to the weights' precision
}


def kept(spec: ModelSpec, values: Sequence[Any], rows: int | None) -> Arrays:
    """A batch's outputs left on its device, cast to the spec's dtypes, each a
    ``DeviceTensor`` of its own memory (a graph's outputs are its next replay's): for a
    batch of requests whose outputs all go into CUDA shared memory there."""
    out: Arrays = {}
    for t, value in zip(spec.outputs, values, strict=True):
        v = value[:rows] if rows is not None else value
        own = v.to(torch_dtype(t.dtype.numpy), copy=True)
        out[t.name] = DeviceTensor(own, t.dtype.numpy)  # type: ignore[assignment]
    return out


class _Lane:
    """One instance's stream, CUDA graphs and buffers: nothing in it is shared with another
    lane, so lanes run batches concurrently on one device."""

    def __init__(self, runner: TorchRunner, gpu: Cuda, index: int) -> None:
        self.index = index
        self.gpu = gpu
        self.stream = gpu.stream(runner.device)
        self.graphs: dict[int, tuple[Any, list[Any], Sequence[Any]]] = {}
        self._device_in: dict[tuple[str, Any], Any] = {}
        self._host_out: dict[tuple[str, Any], Any] = {}
        self._runner = runner

    def upload(self, name: str, a: Any, made: Any) -> Any:
        """``a`` on the device as it came: one asynchronous copy on this lane's stream when
        ``a`` is pinned, as staging is (casts and layout follow on the device). A tensor
        already on the device (a ``DeviceTensor``: ``stages.DeviceDecode``'s, a batch
        gathered from CUDA shared memory) is taken where it is, once its ``ready`` event
        (``made`` for a bare tensor: the caller's stream) has passed, and held on this
        lane's stream until the lane is done with it. Runs on this lane's stream."""
        r = self._runner
        torch = r._torch
        if isinstance(a, DeviceTensor) or torch.is_tensor(a):
            tensor, ready = (a.tensor, a.ready) if isinstance(a, DeviceTensor) else (a, made)
            self.gpu.wait(self.stream, ready)
            if tensor.device != r.device:
                return tensor.to(r.device)
            self.gpu.hold(tensor, self.stream)
            return tensor
        src = torch.from_numpy(np.ascontiguousarray(a))
        raw = self._buffer(self._device_in, name, src.dtype, src.shape, r.device, pin=False)
        raw = raw[: len(src)]
        raw.copy_(src, non_blocking=True)
        return raw

    def download(self, values: Sequence[Any], rows: int | None) -> Arrays:
        """The outputs cast on the device to the spec's dtypes, copied into this lane's
        pinned host buffers, one synchronisation, then copied out (the buffers are reused)."""
        r = self._runner
        staged = []
        for t, value in zip(r._spec.outputs, values, strict=True):
            v = value[:rows] if rows is not None else value
            want = torch_dtype(t.dtype.numpy)
            v = v.to(want)
            host = self._buffer(self._host_out, t.name, want, v.shape, "cpu", pin=True)[: len(v)]
            host.copy_(v, non_blocking=True)
            staged.append((t.name, host))
        self.gpu.synchronize(self.stream)
        return {name: host.numpy().copy() for name, host in staged}

    def keep(self, values: Sequence[Any], rows: int | None) -> Arrays:
        """The outputs left on the device (``kept``), once this lane's stream made them."""
        out = kept(self._runner._spec, values, rows)
        self.gpu.synchronize(self.stream)
        return out

    def _buffer(
        self, cache: dict[tuple[str, Any], Any], name: str, dtype: Any, shape: Any, device: Any,
        *, pin: bool,
    ) -> Any:  # fmt: skip
        """A reused buffer of at least ``shape``'s rows (capacity: the model's max batch)."""
        r = self._runner
        key = (name, dtype)
        buf = cache.get(key)
        rows = shape[0] if len(shape) else 1
        if buf is None or tuple(buf.shape[1:]) != tuple(shape[1:]) or len(buf) < rows:
            cap = max(rows, r._spec.max_batch_size or 1)
            size = (cap, *shape[1:])
            buf = (
                self.gpu.pinned(size, dtype)
                if pin
                else r._torch.empty(size, dtype=dtype, device=device)
            )
            cache[key] = buf
        return buf


class TorchRunner(BaseRunner):
    """Runs a PyTorch module (or an ONNX file via ``onnx_module``) on CPU or CUDA.

    On CUDA each of ``instances`` lanes has its own stream, CUDA graphs and static buffers
    (``runners.lanes``): a batch's host-to-device copy, from the pinned staging the runner
    lends (``staging``), overlaps another lane's compute; casts and channels-last happen on
    the device; outputs come back through pinned buffers with one synchronisation a batch.

    Args:
        model: an ONNX path, or a ``torch.nn.Module`` (then ``spec`` is required).
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        precision: ``fp32``, ``fp16`` or ``bf16`` for weights and activations; inputs are
            cast on the device and outputs are returned in the spec's dtype.
        channels_last: NHWC memory format, which tensor-core convolutions prefer.
        cuda_graphs: capture one CUDA graph per size in ``graph_batch_sizes`` (CUDA only,
            and only for fixed non-batch dimensions: a model with a variable one runs
            eagerly, as the log says once).
        preferred_batch_sizes: extra sizes to capture (the batching policy's).
        instances: batches that may run at once (the model's ``instances``): one lane each.
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
        instances: int = 1,
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
        requested = torch.device(device)
        self._gpu = for_device(requested)
        if self._gpu is not None and not self._gpu.available():
            raise RuntimeError(f"TorchRunner: device {device!r} asked for, but CUDA is unavailable")
        self.device = self._gpu.device(device) if self._gpu is not None else requested
        self.accelerated = requested.type != "cpu"
        self.dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[
            precision
        ]
        self.precision = precision
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        self._channels_last = channels_last
        self._torch = torch
        if self._gpu is None:
            self._module = module.to(self.device, dtype=self.dtype, memory_format=fmt).eval()
        else:  # the weights' copy and casts on a stream of servekit's, done before any lane
            stream = self._gpu.side_stream(self.device)
            with self._gpu.using(stream):
                self._module = module.to(self.device, dtype=self.dtype, memory_format=fmt).eval()
            self._gpu.synchronize(stream)
        self.graph_sizes: tuple[int, ...] = ()
        self._lanes: Lanes[_Lane] | None = None
        if self._gpu is not None:
            gpu = self._gpu
            serving_backends(torch)
            variable = [t.name for t in spec.inputs if -1 in t.shape]
            if cuda_graphs and spec.batched and not variable:
                self.graph_sizes = graph_batch_sizes(spec.max_batch_size, preferred_batch_sizes)
            elif cuda_graphs and variable:
                log.info(
                    "TorchRunner: input %s has a variable dimension: no CUDA graphs (a graph "
                    "holds one shape); batches run eagerly on the lanes' streams",
                    ", ".join(repr(n) for n in variable),
                )  # fmt: skip
            self._lanes = Lanes(lambda i: self._capture(_Lane(self, gpu, i)), instances)

    @cached_property
    def staging(self) -> StagingPool:
        """Pinned host buffers on CUDA (the copy to the device is then one asynchronous
        DMA), plain reused arrays on the CPU."""
        gpu = self._gpu
        if gpu is None:
            return StagingPool(self._spec.max_batch_size)

        def pinned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            return gpu.pinned(shape, torch_dtype(dtype)).numpy()  # type: ignore[no-any-return]

        inputs = [(t.name, t.dtype.numpy, tuple(t.shape)) for t in self._spec.inputs]
        lanes = len(self._lanes) if self._lanes is not None else 1
        return StagingPool(
            self._spec.max_batch_size, pinned, pinned=True, inputs=inputs, lanes=lanes
        )

    def _on_device(self, t: Any) -> Any:
        """A device tensor cast to the runner's precision and memory format."""
        if not t.is_floating_point():
            return t  # pixels (UINT8 NHWC): the graph casts and transposes them itself
        t = t.to(self.dtype)
        if self._channels_last and t.dim() == 4:
            t = t.contiguous(memory_format=self._torch.channels_last)
        return t

    def _to_device(self, a: Any) -> Any:
        torch = self._torch
        t = a if torch.is_tensor(a) else torch.from_numpy(np.ascontiguousarray(a))
        return self._on_device(t.to(self.device))

    @property
    def tensor_device(self) -> Any:
        """The device whose torch tensors ``run`` takes as inputs as they are (no copy):
        this runner's."""
        return self.device

    def _outputs(self, values: Sequence[Any], rows: int | None) -> Arrays:
        out = {}
        for t, value in zip(self._spec.outputs, values, strict=True):
            v = value[:rows] if rows is not None else value
            out[t.name] = v.float().cpu().numpy().astype(t.dtype.numpy, copy=False)
        return out

    def _call(self, *args: Any) -> Sequence[Any]:
        """The module's outputs in the spec's order: a module with one output returns a
        tensor, not a tuple of one."""
        values = self._module(*args)
        return (values,) if self._torch.is_tensor(values) else values

    def _capture(self, lane: _Lane) -> _Lane:
        """Warm the kernels and capture one graph per size, all on ``lane``'s own stream."""
        gpu = lane.gpu
        with self._torch.inference_mode():
            for n in self.graph_sizes:
                with gpu.using(lane.stream):
                    static = [self._to_device(a) for a in self._spec.sample_inputs(n).values()]
                    for _ in range(2):  # the kernels' autotuning, outside the graph
                        self._module(*static)
                gpu.synchronize(lane.stream)
                graph, result = gpu.capture(lane.stream, partial(self._call, *static))
                lane.graphs[n] = (graph, static, result)
        return lane

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        torch = self._torch
        ordered = [(t.name, inputs[t.name]) for t in self._spec.inputs]
        rows = len(ordered[0][1]) if self._spec.batched else None
        keep = all(getattr(a, "keep_outputs", False) for a in inputs.values()) and bool(inputs)
        if self._lanes is None or self._gpu is None:
            with torch.inference_mode():
                values = self._call(*(self._to_device(unwrap(a)) for _, a in ordered))
                return kept(self._spec, values, None) if keep else self._outputs(values, None)
        gpu = self._gpu
        # A bare tensor (a caller's own) was made on the caller's current stream.
        made = (
            gpu.current_ready(self.device) if any(torch.is_tensor(a) for _, a in ordered) else None
        )
        size = next((n for n in self.graph_sizes if rows is not None and n >= rows), None)
        with self._lanes.use() as lane, torch.inference_mode(), gpu.using(lane.stream):
            answer = lane.keep if keep else lane.download
            raw = [lane.upload(name, a, made) for name, a in ordered]
            if size is None:
                return answer(self._call(*map(self._on_device, raw)), None)
            graph, static, result = lane.graphs[size]
            for dst, x in zip(static, raw, strict=True):
                dst[:rows].copy_(x)  # the cast and channels-last, one kernel on the device
            graph.replay()
            return answer(result, rows)

    def replay(self, batch: int, times: int) -> None:
        """Replay the first lane's graph for ``batch`` rows ``times`` times and wait: the
        engine alone, with no host work (``bench/gpu.py``'s ceiling)."""
        assert self._lanes is not None, "replay needs CUDA graphs"
        lane = self._lanes.all[0]
        graph = lane.graphs[batch][0]
        with lane.gpu.using(lane.stream):
            for _ in range(times):
                graph.replay()
        lane.gpu.synchronize(lane.stream)

    def close(self) -> None:
        self._lanes = None
        self._module = None
        if "staging" in self.__dict__:  # made (cached_property): its pinned memory goes
            self.staging.close()
        if self._gpu is not None:
            self._gpu.empty_cache()
