"""ONNX Runtime runner: the embedded default engine (CPU here, any ORT execution provider)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..spec import ModelSpec, TensorSpec
from .base import Arrays, BaseRunner

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "OnnxRuntimeRunner"]

DEFAULT_MAX_BATCH_SIZE = 64
"""``max_batch_size`` given to ONNX models with a dynamic leading dim when the caller sets none."""

# ORT reports element types as "tensor(<onnx type>)".
_ORT_TYPES = {
    "tensor(bool)": np.bool_,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(float16)": np.float16,
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(string)": np.object_,
}


def _is_dynamic(dim: Any) -> bool:
    return not isinstance(dim, int) or dim < 0


def spec_from_session(session: Any, max_batch_size: int | None = None) -> ModelSpec:
    """Derive a ModelSpec from an ORT session's graph inputs and outputs.

    A model batches (Triton's implicit batch dim) when the leading dim of every input
    and output is dynamic; its ``max_batch_size`` is then ``max_batch_size`` or
    ``DEFAULT_MAX_BATCH_SIZE``. Other dynamic dims become ``-1``.
    """
    ins, outs = session.get_inputs(), session.get_outputs()
    batched = all(len(t.shape) > 0 and _is_dynamic(t.shape[0]) for t in (*ins, *outs))
    if max_batch_size == 0:
        batched = False

    def tensor(t: Any) -> TensorSpec:
        if t.type not in _ORT_TYPES:
            raise ValueError(f"ONNX tensor {t.name!r} has unsupported type {t.type}")
        dims = list(t.shape[1:] if batched else t.shape)
        return TensorSpec(t.name, _ORT_TYPES[t.type], [-1 if _is_dynamic(d) else d for d in dims])

    mbs = (max_batch_size or DEFAULT_MAX_BATCH_SIZE) if batched else 0
    return ModelSpec(tuple(map(tensor, ins)), tuple(map(tensor, outs)), mbs)


class OnnxRuntimeRunner(BaseRunner):
    """Runs an ONNX model with ONNX Runtime; the spec is read from the graph.

    Args:
        model: path to a ``.onnx`` file, or its bytes.
        intra_op_threads: threads inside one operator (ORT default: one per core).
        inter_op_threads: threads across independent operators.
        providers: ORT execution providers, CPU by default.
        max_batch_size: for models with a dynamic leading dim; 0 forces "not batched".
        optimization_level: ORT graph optimisation (``"all"``, ``"extended"``, ``"basic"``, ``"off"``).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        *,
        intra_op_threads: int | None = None,
        inter_op_threads: int | None = None,
        providers: Sequence[str] | None = None,
        max_batch_size: int | None = None,
        optimization_level: str = "all",
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        if inter_op_threads is not None:
            options.inter_op_num_threads = inter_op_threads
        levels = {
            "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }
        if optimization_level not in levels:
            raise ValueError(
                f"optimization_level must be one of {sorted(levels)}, got {optimization_level!r}"
            )
        options.graph_optimization_level = levels[optimization_level]
        source = model if isinstance(model, bytes) else str(Path(model))
        self.path = None if isinstance(model, bytes) else Path(model)
        self._session = ort.InferenceSession(
            source, sess_options=options, providers=list(providers or ["CPUExecutionProvider"])
        )
        self._spec = spec_from_session(self._session, max_batch_size)
        self.metadata: dict[str, str] = dict(self._session.get_modelmeta().custom_metadata_map)
        """The model's ``metadata_props`` (zoo models carry labels and input scaling there)."""
        self._output_names = [t.name for t in self._spec.outputs]

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        # ORT reads C-contiguous numpy buffers in place; copy only arrays that are not.
        feed = {
            name: (a if a.flags.c_contiguous else np.ascontiguousarray(a))
            for name, a in inputs.items()
        }
        results = self._session.run(self._output_names, feed)
        return dict(zip(self._output_names, results, strict=True))

    def close(self) -> None:
        self._session = None  # type: ignore[assignment]
