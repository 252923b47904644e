"""ONNX Runtime runner: the embedded default engine (CPU here, any ORT execution provider)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..spec import ModelSpec, TensorSpec
from .base import Arrays, BaseRunner

__all__ = ["DEFAULT_MAX_BATCH_SIZE", "OnnxRuntimeRunner", "spec_from_onnx", "spec_from_session"]

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


def _spec(
    ins: list[tuple[str, Any, list[Any]]],
    outs: list[tuple[str, Any, list[Any]]],
    max_batch_size: int | None,
) -> ModelSpec:
    """A ModelSpec from ``(name, numpy dtype, dims)`` triples, dynamic dims as ``None``."""
    batched = all(len(dims) > 0 and dims[0] is None for _, _, dims in (*ins, *outs))
    if max_batch_size == 0:
        batched = False

    def tensor(name: str, dtype: Any, dims: list[Any]) -> TensorSpec:
        kept = dims[1:] if batched else dims
        return TensorSpec(name, dtype, [-1 if d is None else d for d in kept])

    mbs = (max_batch_size or DEFAULT_MAX_BATCH_SIZE) if batched else 0
    return ModelSpec(tuple(tensor(*t) for t in ins), tuple(tensor(*t) for t in outs), mbs)


def spec_from_session(session: Any, max_batch_size: int | None = None) -> ModelSpec:
    """Derive a ModelSpec from an ORT session's graph inputs and outputs.

    A model batches (Triton's implicit batch dim) when the leading dim of every input
    and output is dynamic; its ``max_batch_size`` is then ``max_batch_size`` or
    ``DEFAULT_MAX_BATCH_SIZE``. Other dynamic dims become ``-1``.
    """

    def triple(t: Any) -> tuple[str, Any, list[Any]]:
        if t.type not in _ORT_TYPES:
            raise ValueError(f"ONNX tensor {t.name!r} has unsupported type {t.type}")
        return t.name, _ORT_TYPES[t.type], [None if _is_dynamic(d) else d for d in t.shape]

    return _spec(
        [triple(t) for t in session.get_inputs()],
        [triple(t) for t in session.get_outputs()],
        max_batch_size,
    )


def spec_from_onnx(model: str | os.PathLike[str], max_batch_size: int | None = None) -> ModelSpec:
    """The same ModelSpec as ``spec_from_session``, read from the ONNX file without a session
    (for engines other than ONNX Runtime)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(model), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}

    def triple(v: Any) -> tuple[str, Any, list[Any]]:
        t = v.type.tensor_type
        dtype = np.dtype(object) if t.elem_type == onnx.TensorProto.STRING else None
        try:
            dtype = dtype or tensor_dtype_to_np_dtype(t.elem_type)
        except KeyError:
            raise ValueError(
                f"ONNX tensor {v.name!r} has unsupported element type {t.elem_type}"
            ) from None
        dims = [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in t.shape.dim
        ]
        return v.name, np.dtype(dtype).type, dims

    return _spec(
        [triple(v) for v in graph.input if v.name not in weights],
        [triple(v) for v in graph.output],
        max_batch_size,
    )


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
        self.threads = intra_op_threads
        """Intra-op threads asked for (None: ONNX Runtime's default)."""
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
        self.accelerated = self._session.get_providers()[0] != "CPUExecutionProvider"
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
