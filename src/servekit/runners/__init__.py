"""Engine runners: the Runner contract and its implementations (engines import lazily)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from .base import BaseRunner, FunctionRunner, Runner
from .onnx import OnnxRuntimeRunner

ENGINES = ("onnxruntime", "tensorrt", "torch")
"""The engines ``load_runner`` (and ``ModelConfig.engine``) accepts."""

__all__ = ["ENGINES", "BaseRunner", "FunctionRunner", "OnnxRuntimeRunner", "Runner", "load_runner"]


def load_runner(
    model: str | os.PathLike[str],
    *,
    engine: str = "onnxruntime",
    precision: str = "fp32",
    max_batch_size: int | None = None,
    preferred_batch_sizes: Sequence[int] = (),
    threads: int | None = None,
    device: str | None = None,
    instances: int = 1,
) -> BaseRunner:
    """One ONNX file on the named engine: the one switch every runtime (Triton backend,
    PyTriton, Ray) goes through, so ``runner``/``precision`` mean the same everywhere.

    ONNX Runtime runs the file at the precision it was written in (make INT8/FP16 files
    with ``servekit optimize``); TensorRT and Torch convert at load. A file that declares
    a device profile (the zoo's ``sim_t4``) runs on a ``SimulatedDevice``. ``device`` is a CUDA
    ordinal for TensorRT and a torch device (``cuda``, ``cuda:1``, ``cpu``) for Torch.
    ``instances`` is how many batches may run at once (the model's ``instances`` where one
    runner serves them all): a GPU runner keeps a lane (stream, graphs, buffers) for each.
    """
    if engine == "onnxruntime":
        if precision != "fp32":
            raise ValueError(
                f"onnxruntime runs the model file as written, so precision must be fp32, got "
                f"{precision!r}: make an {precision} file with `servekit optimize`"
            )
        runner = OnnxRuntimeRunner(model, intra_op_threads=threads, max_batch_size=max_batch_size)
        from .simulated import DeviceProfile, SimulatedDevice

        profile = DeviceProfile.from_metadata(runner.metadata)
        return runner if profile is None else SimulatedDevice(runner, profile)
    if engine == "tensorrt":
        from .tensorrt import TensorRTRunner

        return TensorRTRunner(
            model,
            precision=precision,
            max_batch_size=max_batch_size,
            preferred_batch_sizes=preferred_batch_sizes,
            device=int(device or 0),
            instances=instances,
        )
    if engine == "torch":
        from .torch import TorchRunner

        return TorchRunner(
            model,
            precision=precision,
            device=device or "cuda",
            max_batch_size=max_batch_size,
            preferred_batch_sizes=preferred_batch_sizes,
            instances=instances,
        )
    raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
