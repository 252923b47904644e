"""TensorRT runner: an ONNX model built into an engine for the GPU at hand, cached on disk.

TensorRT 10's named-tensor API: one optimisation profile spans the batching policy's
batch sizes (min 1, opt the largest preferred size, max ``max_batch_size``); FP16/BF16
are builder flags, INT8 comes from an explicitly quantised (QDQ) ONNX model, the kind
``servekit optimize --precision int8 --target tensorrt`` writes. Engines and the timing
cache are keyed by GPU, compute capability, TensorRT version, precision, profile and
the model's bytes, so a cached engine is never loaded on a GPU it was not built for.
Execution is ``execute_async_v3`` on the runner's own CUDA stream, into device buffers
allocated once for the largest batch, through pinned host buffers (memory via
``cuda-python``). Inputs already on the GPU (torch tensors: CUDA shared memory's
``DeviceTensor``, ``stages.DeviceDecode``'s images) are copied device to device, never
through the host, where torch is installed to carry them: cast on the lane's own stream
once their ``ready`` event has passed. Every stream is non-blocking and nothing runs on
the legacy default stream (``servekit.cuda``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..cuda import for_device, layer
from ..device import DeviceTensor, torch_dtype, unwrap
from ..errors import RunnerError
from ..spec import ModelSpec
from .base import Arrays, BaseRunner
from .lanes import Lanes
from .onnx import spec_from_onnx
from .staging import StagingPool

__all__ = [
    "TRT_PRECISIONS",
    "EngineKey",
    "TensorRTRunner",
    "device_source",
    "engine_cache_dir",
    "is_explicitly_quantized",
    "optimization_profile",
]

TRT_PRECISIONS = ("fp32", "fp16", "bf16", "int8")

Profile = tuple[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]
"""Per input: ``(name, min shape, opt shape, max shape)``, batch dim included."""


def optimization_profile(
    spec: ModelSpec, max_batch_size: int | None = None, preferred_batch_sizes: Sequence[int] = ()
) -> Profile:
    """The one optimisation profile that covers every batch the policy can form.

    ``opt`` is the largest preferred batch size (what the batcher aims for), else the
    maximum. Variable non-batch dims have no range to build for, so they are refused.
    """
    most = max_batch_size or spec.max_batch_size
    fits = [b for b in preferred_batch_sizes if 1 <= b <= most]
    opt = max(fits) if fits else most
    out = []
    for t in spec.inputs:
        if -1 in t.shape:
            raise ValueError(
                f"input {t.name!r} has a variable dim {list(t.shape)}: a TensorRT profile "
                "needs fixed non-batch dims (export the model with them fixed)"
            )
        dims = tuple(t.shape)
        if spec.batched:
            out.append((t.name, (1, *dims), (opt, *dims), (most, *dims)))
        else:
            out.append((t.name, dims, dims, dims))
    return tuple(out)


def is_explicitly_quantized(model: str | os.PathLike[str]) -> bool:
    """Whether the ONNX graph carries Q/DQ nodes (TensorRT's explicit INT8)."""
    import onnx

    graph = onnx.load(str(model), load_external_data=False).graph
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in graph.node)


def engine_cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where engines live: ``override``, else ``$SERVEKIT_CACHE/engines``, else
    ``~/.cache/servekit/engines``."""
    if override:
        return Path(override)
    env = os.environ.get("SERVEKIT_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "servekit") / "engines"


@dataclass(frozen=True)
class EngineKey:
    """Everything an engine depends on; a change in any field means a new build."""

    model_sha256: str
    precision: str
    gpu: str
    compute_capability: tuple[int, int]
    tensorrt_version: str
    profile: Profile

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()

    def engine_file(self, stem: str = "model") -> str:
        """``<stem>.<precision>.sm<cc>.trt<version>.<digest>.engine``, safe as a file name."""
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in stem) or "model"
        major, minor = self.compute_capability
        version = self.tensorrt_version.replace(".", "_")
        return f"{safe}.{self.precision}.sm{major}{minor}.trt{version}.{self.digest()[:16]}.engine"

    def timing_cache_file(self) -> str:
        """Timing caches are shared by every model on the same GPU and TensorRT."""
        major, minor = self.compute_capability
        gpu = "".join(c if c.isalnum() else "_" for c in self.gpu)
        return f"timing.{gpu}.sm{major}{minor}.trt{self.tensorrt_version.replace('.', '_')}.cache"


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tensorrt() -> Any:
    try:
        import tensorrt
    except ImportError:
        raise ImportError(
            "TensorRTRunner needs TensorRT 10 and an NVIDIA GPU: pip install 'servekit[tensorrt]'"
        ) from None
    return tensorrt


def _cudart() -> Any:
    try:
        return layer().runtime()
    except ImportError:
        raise ImportError(
            "TensorRTRunner needs cuda-python: pip install 'servekit[tensorrt]'"
        ) from None


class _Cuda:
    """The few CUDA runtime calls the runner makes, each checked."""

    def __init__(self) -> None:
        self.rt = _cudart()

    def __call__(self, name: str, *args: Any) -> Any:
        result = getattr(self.rt, name)(*args)
        err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if int(err) != 0:
            _, text = self.rt.cudaGetErrorString(err)
            raise RunnerError(f"CUDA {name}: {text.decode() if isinstance(text, bytes) else text}")
        return rest[0] if len(rest) == 1 else rest


class TensorRTRunner(BaseRunner):
    """Runs an ONNX model as a TensorRT engine on one GPU (built once, then cached).

    Args:
        model: the ``.onnx`` file (QDQ for ``int8``).
        precision: ``fp32``, ``fp16``, ``bf16`` or ``int8``.
        max_batch_size, preferred_batch_sizes: the batching policy's; they set the profile.
        cache_dir: engine and timing cache directory (``engine_cache_dir()``).
        device: CUDA device ordinal.
        workspace_bytes: the builder's workspace pool limit.
        instances: batches that may run at once: one lane (execution context, stream,
            device and pinned output buffers) each, as ``TorchRunner``'s.
    """

    accelerated = True

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        precision: str = "fp16",
        max_batch_size: int | None = None,
        preferred_batch_sizes: Sequence[int] = (),
        cache_dir: str | os.PathLike[str] | None = None,
        device: int = 0,
        workspace_bytes: int = 4 << 30,
        instances: int = 1,
    ) -> None:
        if precision not in TRT_PRECISIONS:
            raise ValueError(f"precision must be one of {TRT_PRECISIONS}, got {precision!r}")
        self.path = Path(model)
        if precision == "int8" and not is_explicitly_quantized(self.path):
            raise ValueError(
                f"int8 on TensorRT needs an explicitly quantised (QDQ) model; {self.path.name} has "
                "no Q/DQ nodes: run `servekit optimize MODEL --precision int8 --target tensorrt`"
            )
        self._spec = spec_from_onnx(self.path, max_batch_size)
        profile = optimization_profile(self._spec, max_batch_size, preferred_batch_sizes)
        trt = _tensorrt()
        self._cuda = cuda = _Cuda()
        cuda("cudaSetDevice", device)
        props = cuda("cudaGetDeviceProperties", device)
        gpu = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
        self.key = EngineKey(
            _file_sha256(self.path),
            precision,
            gpu.strip("\x00"),
            (int(props.major), int(props.minor)),
            trt.__version__,
            profile,
        )
        self.precision, self.device = precision, device
        self._logger = trt.Logger(trt.Logger.WARNING)
        cache = engine_cache_dir(cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        self.engine_path = cache / self.key.engine_file(self.path.stem)
        if self.engine_path.is_file():
            blob = self.engine_path.read_bytes()
        else:
            blob = self._build(trt, profile, cache / self.key.timing_cache_file(), workspace_bytes)
            tmp = self.engine_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(blob)
            tmp.replace(self.engine_path)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(blob)
        if self._engine is None:
            raise RunnerError(f"TensorRT could not load {self.engine_path}")
        self._instances = instances
        self._lanes: Lanes[_Lane] | None = Lanes(
            lambda i: _Lane(self._engine, self._cuda, trt, profile), instances
        )

    def _build(self, trt: Any, profile: Profile, timing_file: Path, workspace: int) -> bytes:
        builder = trt.Builder(self._logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, self._logger)
        if not parser.parse_from_file(str(self.path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RunnerError(f"TensorRT cannot parse {self.path.name}: {errors}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
        flags = {"fp16": ["FP16"], "bf16": ["BF16"], "int8": ["INT8", "FP16"]}
        for flag in flags.get(self.precision, []):
            config.set_flag(getattr(trt.BuilderFlag, flag))
        timing = config.create_timing_cache(
            timing_file.read_bytes() if timing_file.is_file() else b""
        )
        config.set_timing_cache(timing, ignore_mismatch=False)
        shapes = builder.create_optimization_profile()
        for name, lo, opt, hi in profile:
            shapes.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(shapes)
        blob = builder.build_serialized_network(network, config)
        if blob is None:
            raise RunnerError(f"TensorRT could not build {self.path.name} at {self.precision}")
        timing_file.write_bytes(bytes(config.get_timing_cache().serialize()))
        return bytes(blob)

    @cached_property
    def staging(self) -> StagingPool:
        """Page-locked host buffers (``cudaMallocHost``): a batch's input is copied to the
        device straight from where the batcher gathered it, asynchronously. One staging per
        lane is allocated up front; a buffer outgrown is freed (``cudaFreeHost``), and the
        rest when the runner closes (never while a batch holds them: ``VersionedRunner``)."""
        cuda = self._cuda

        def pinned(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
            nbytes = max(int(np.prod(shape)) * dtype.itemsize, 1)
            ptr = int(cuda("cudaMallocHost", nbytes))
            raw = (ctypes.c_byte * nbytes).from_address(ptr)
            return np.frombuffer(memoryview(raw), dtype=dtype, count=int(np.prod(shape))).reshape(
                shape
            )

        def free(buffer: np.ndarray) -> None:  # an array ``pinned`` made: its first byte
            cuda("cudaFreeHost", buffer.ctypes.data)

        inputs = [(t.name, t.dtype.numpy, tuple(t.shape)) for t in self._spec.inputs]
        return StagingPool(
            self._spec.max_batch_size, pinned, pinned=True, free=free, inputs=inputs,
            lanes=self._instances,
        )  # fmt: skip

    @property
    def tensor_device(self) -> Any:
        """The device whose torch tensors ``run`` takes without a host copy: this runner's
        GPU, where a CUDA build of torch is installed (None without one: inputs then come as
        host arrays)."""
        try:
            gpu = layer()
            if not gpu.available():  # a CPU-only torch beside TensorRT carries nothing
                return None
        except ImportError:
            return None
        return gpu.device(self.device)

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        assert self._lanes is not None, "the runner is closed"
        with self._lanes.use() as lane:
            return lane.run(self._spec, inputs, self.path.name)

    def close(self) -> None:
        lanes, self._lanes = getattr(self, "_lanes", None), None
        if lanes is None:
            return
        for lane in lanes.all:
            lane.close()
        if "staging" in self.__dict__:  # made (cached_property): its pinned memory goes
            self.staging.close()
        self._engine = None


class _Lane:
    """One instance's execution context, stream, device buffers and pinned output buffers."""

    def __init__(self, engine: Any, cuda: _Cuda, trt: Any, profile: Profile) -> None:
        self._cuda = cuda
        self.context = engine.create_execution_context()
        self.stream = cuda("cudaStreamCreateWithFlags", cuda.rt.cudaStreamNonBlocking)
        self._torch_stream: Any = None
        self.buffers: dict[str, tuple[int, np.ndarray, int]] = {}
        largest = {name: hi for name, _, _, hi in profile}
        for name, hi in largest.items():
            self.context.set_input_shape(name, hi)
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            shape = tuple(largest.get(name) or self.context.get_tensor_shape(name))
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            nbytes = int(np.prod(shape)) * dtype.itemsize
            device = cuda("cudaMalloc", nbytes)
            host_ptr = cuda("cudaMallocHost", nbytes)
            raw = (ctypes.c_byte * nbytes).from_address(int(host_ptr))
            host = np.frombuffer(memoryview(raw), dtype=dtype).reshape(shape)
            self.buffers[name] = (int(device), host, int(host_ptr))
            self.context.set_tensor_address(name, int(device))

    def run(self, spec: ModelSpec, inputs: Mapping[str, np.ndarray], model: str) -> Arrays:
        """One batch: inputs copied to the device from where they are when they already are
        in the engine's dtype (staging's pinned buffers), else cast into this lane's pinned
        buffer first; an input on the GPU is cast there and copied device to device; one
        synchronisation; outputs copied out of the reused buffers."""
        cuda, rt = self._cuda, self._cuda.rt
        h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        held = []  # device sources, alive until the stream is done with them
        for t in spec.inputs:
            a = inputs[t.name]
            device, host, _ = self.buffers[t.name]
            on_gpu = device_source(a, host.dtype, self._as_torch)
            if on_gpu is not None:
                held.append(on_gpu)
                self.context.set_input_shape(t.name, tuple(on_gpu.shape))
                nbytes = on_gpu.numel() * on_gpu.element_size()
                d2d = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
                cuda("cudaMemcpyAsync", device, on_gpu.data_ptr(), nbytes, d2d, self.stream)
                continue
            a = np.asarray(a)  # a CPU tensor's or a DeviceTensor's rows on the host
            if a.dtype != host.dtype or not a.flags.c_contiguous:
                view = host.reshape(-1)[: a.size].reshape(a.shape)
                view[...] = a
                a = view
            self.context.set_input_shape(t.name, a.shape)
            cuda("cudaMemcpyAsync", device, a.ctypes.data, a.nbytes, h2d, self.stream)
        if not self.context.execute_async_v3(self.stream):
            raise RunnerError(f"TensorRT: {model} failed to execute")
        shapes = {}
        for t in spec.outputs:
            device, host, _ = self.buffers[t.name]
            shapes[t.name] = tuple(self.context.get_tensor_shape(t.name))
            view = host.reshape(-1)[: int(np.prod(shapes[t.name]))]
            cuda("cudaMemcpyAsync", view.ctypes.data, device, view.nbytes, d2h, self.stream)
        cuda("cudaStreamSynchronize", self.stream)
        return {
            t.name: self.buffers[t.name][1]
            .reshape(-1)[: int(np.prod(shapes[t.name]))]
            .reshape(shapes[t.name])
            .astype(t.dtype.numpy, copy=True)
            for t in spec.outputs
        }

    def _as_torch(self, device: Any) -> Any:
        """This lane's stream as torch takes it (an input on the GPU is cast there)."""
        if self._torch_stream is None:
            self._torch_stream = layer().external(self.stream, device)
        return self._torch_stream

    def close(self) -> None:
        for device, _, host_ptr in self.buffers.values():
            self._cuda("cudaFree", device)
            self._cuda("cudaFreeHost", host_ptr)
        self.buffers.clear()
        self._cuda("cudaStreamDestroy", self.stream)
        self.context = None


def device_source(a: Any, dtype: np.dtype, stream_of: Any) -> Any:
    """``a``'s torch tensor when it is on a GPU, cast to ``dtype`` and made contiguous on
    ``stream_of(device)`` (a lane's stream as torch takes it) once ``a`` is made, so a copy
    later on that stream reads it; None for anything on the host (an array, a CPU tensor)."""
    tensor = unwrap(a)
    device = getattr(tensor, "device", None)
    gpu = for_device(device) if device is not None else None
    if gpu is None:
        return None
    stream = stream_of(device)
    ready = a.ready if isinstance(a, DeviceTensor) else gpu.current_ready(device)
    gpu.wait(stream, ready)
    with gpu.using(stream):
        cast = tensor.to(torch_dtype(dtype)).contiguous()
    gpu.hold(tensor, stream)
    return cast
