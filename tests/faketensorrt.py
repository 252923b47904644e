"""A stand-in for TensorRT 10's Python API, the calls ``TensorRTRunner`` makes, over the fake
device (``fakecuda``): the "engine" is the ONNX model, run by ONNX Runtime when its
``execute_async_v3`` job runs on the stream, reading and writing the device buffers at
the addresses the runner set. So the runner's own code (its lanes, streams, pinned
staging and copies) runs as written; only the engine and the device are models."""

from __future__ import annotations

import ctypes
import types
from typing import Any

import numpy as np

__version__ = "10.0.fake"


def _at(ptr: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The array at ``ptr`` (host memory standing for the device's)."""
    count = int(np.prod(shape, dtype=np.int64))
    raw = (ctypes.c_byte * max(count * dtype.itemsize, 1)).from_address(int(ptr))
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)


class Logger:
    WARNING = 2

    def __init__(self, level: int = 2) -> None:
        self.level = level


class _Cache:
    def serialize(self) -> bytes:
        return b"timing"


class _Config:
    def set_memory_pool_limit(self, pool: Any, size: int) -> None:
        pass

    def set_flag(self, flag: Any) -> None:
        pass

    def create_timing_cache(self, blob: bytes) -> _Cache:
        return _Cache()

    def set_timing_cache(self, cache: _Cache, ignore_mismatch: bool) -> None:
        pass

    def add_optimization_profile(self, profile: Any) -> None:
        pass

    def get_timing_cache(self) -> _Cache:
        return _Cache()


class _Profile:
    def set_shape(self, name: str, lo: Any, opt: Any, hi: Any) -> None:
        pass


class _Network:
    path = ""


class OnnxParser:
    num_errors = 0

    def __init__(self, network: _Network, logger: Logger) -> None:
        self.network = network

    def parse_from_file(self, path: str) -> bool:
        self.network.path = path
        return True


class Builder:
    def __init__(self, logger: Logger) -> None:
        pass

    def create_network(self, flags: int) -> _Network:
        return _Network()

    def create_builder_config(self) -> _Config:
        return _Config()

    def create_optimization_profile(self) -> _Profile:
        return _Profile()

    def build_serialized_network(self, network: _Network, config: _Config) -> bytes:
        with open(network.path, "rb") as f:
            return f.read()


MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)
BuilderFlag = types.SimpleNamespace(FP16=1, BF16=2, INT8=3)


def nptype(dtype: Any) -> Any:
    return dtype


class _Engine:
    def __init__(self, blob: bytes) -> None:
        import onnxruntime as ort

        self.session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
        self.inputs = [(i.name, i.shape) for i in self.session.get_inputs()]
        self.outputs = [(o.name, o.shape) for o in self.session.get_outputs()]
        self.names = [n for n, _ in self.inputs + self.outputs]

    @property
    def num_io_tensors(self) -> int:
        return len(self.names)

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_dtype(self, name: str) -> Any:
        return np.dtype(np.float32)

    def create_execution_context(self) -> _Context:
        return _Context(self)


class _Context:
    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def set_input_shape(self, name: str, shape: Any) -> bool:
        self.shapes[name] = tuple(int(d) for d in shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if name in self.shapes:
            return self.shapes[name]
        rows = next(iter(self.shapes.values()))[0] if self.shapes else 1
        shape = dict(self.engine.outputs)[name]
        return tuple(rows if not isinstance(d, int) else d for d in shape)

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream: Any) -> bool:
        from servekit.cuda import layer

        runtime = layer().runtime()
        shapes = dict(self.shapes)
        outputs = {n: self.get_tensor_shape(n) for n, _ in self.engine.outputs}
        addresses = dict(self.addresses)
        f32 = np.dtype(np.float32)

        def run() -> None:
            feeds = {n: _at(addresses[n], shapes[n], f32).copy() for n, _ in self.engine.inputs}
            results = self.engine.session.run(None, feeds)
            for (name, _), value in zip(self.engine.outputs, results, strict=True):
                _at(addresses[name], outputs[name], f32)[...] = value

        runtime.enqueue(stream, run)
        return True


class Runtime:
    def __init__(self, logger: Logger) -> None:
        pass

    def deserialize_cuda_engine(self, blob: bytes) -> _Engine:
        return _Engine(blob)
