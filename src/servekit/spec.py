"""Model signatures: tensor specs, model specs, the dtype table, request validation.

Shapes follow Triton's convention (``model_config.proto``): when
``max_batch_size > 0`` every tensor has an implicit leading batch dimension that
``TensorSpec.shape`` leaves out; ``-1`` marks a variable dimension.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .device import DeviceTensor
from .errors import InvalidInput, RunnerError

__all__ = [
    "DTYPES",
    "DType",
    "ModelSpec",
    "TensorSpec",
    "as_dtype",
    "spec_from_config",
]


@dataclass(frozen=True)
class DType:
    """One row of the dtype table: numpy dtype <-> Triton ``TYPE_*`` <-> KServe v2 datatype."""

    datatype: str
    """KServe v2 / Triton protocol datatype string, e.g. ``FP32``, ``BYTES``."""
    numpy: np.dtype
    triton: str
    """``model_config.proto`` DataType name, e.g. ``TYPE_FP32``, ``TYPE_STRING``."""

    def __str__(self) -> str:
        return self.datatype

    def __repr__(self) -> str:
        return f"DType({self.datatype!r})"


DTYPES: tuple[DType, ...] = (
    DType("BOOL", np.dtype(np.bool_), "TYPE_BOOL"),
    DType("UINT8", np.dtype(np.uint8), "TYPE_UINT8"),
    DType("UINT16", np.dtype(np.uint16), "TYPE_UINT16"),
    DType("UINT32", np.dtype(np.uint32), "TYPE_UINT32"),
    DType("UINT64", np.dtype(np.uint64), "TYPE_UINT64"),
    DType("INT8", np.dtype(np.int8), "TYPE_INT8"),
    DType("INT16", np.dtype(np.int16), "TYPE_INT16"),
    DType("INT32", np.dtype(np.int32), "TYPE_INT32"),
    DType("INT64", np.dtype(np.int64), "TYPE_INT64"),
    DType("FP16", np.dtype(np.float16), "TYPE_FP16"),
    DType("FP32", np.dtype(np.float32), "TYPE_FP32"),
    DType("FP64", np.dtype(np.float64), "TYPE_FP64"),
    # Variable-length bytes travel as numpy object arrays of ``bytes``.
    DType("BYTES", np.dtype(np.object_), "TYPE_STRING"),
)

_BY_NAME: dict[str, DType] = {}
for _d in DTYPES:
    _BY_NAME[_d.datatype] = _d
    _BY_NAME[_d.triton] = _d
_BY_NAME["STRING"] = _BY_NAME["BYTES"]
_BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in DTYPES}


def as_dtype(value: Any) -> DType:
    """Look up a dtype by numpy dtype/type, KServe name (``FP32``) or Triton name (``TYPE_FP32``).

    numpy fixed-width byte/unicode strings (``S``/``U``) map to ``BYTES``.
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, str):
        found = _BY_NAME.get(value) or _BY_NAME.get(value.upper())
        if found is not None:
            return found
    try:
        np_dtype = np.dtype(value)
    except TypeError:
        raise InvalidInput(f"unknown dtype {value!r}; expected one of {sorted(_BY_NAME)}") from None
    if np_dtype.kind in "SUO":
        return _BY_NAME["BYTES"]
    if np_dtype not in _BY_NUMPY:
        raise InvalidInput(f"dtype {np_dtype} has no Triton equivalent")
    return _BY_NUMPY[np_dtype]


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


@dataclass(frozen=True)
class TensorSpec:
    """A named tensor: dtype and shape, ``-1`` for variable dims, batch dim excluded."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    def __init__(self, name: str, dtype: Any, shape: Sequence[int]) -> None:
        if not name:
            raise ValueError("TensorSpec.name must be a non-empty string")
        dims = tuple(int(d) for d in shape)
        if any(d < -1 or d == 0 for d in dims):
            raise ValueError(f"TensorSpec {name!r}: dims must be positive or -1, got {list(dims)}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", as_dtype(dtype))
        object.__setattr__(self, "shape", dims)

    def describe(self) -> str:
        """``name DTYPE [dims]``, as error messages name a tensor."""
        return f"{self.name} {self.dtype.datatype} {_fmt_shape(self.shape)}"

    def dtype_matches(self, array: np.ndarray) -> bool:
        """Whether ``array``'s dtype is this tensor's (BYTES takes object and ``S`` arrays)."""
        if self.dtype.datatype == "BYTES":
            return array.dtype.kind in "OS"
        return array.dtype == self.dtype.numpy

    def shape_matches(self, shape: Sequence[int]) -> bool:
        """Whether a concrete shape (without batch dim) fits this spec."""
        if len(shape) != len(self.shape):
            return False
        if shape == self.shape:
            return True
        return all(want == -1 or want == got for want, got in zip(self.shape, shape, strict=True))


@dataclass(frozen=True)
class ModelSpec:
    """A model's signature: inputs, outputs and ``max_batch_size`` (0 = no implicit batch dim)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int = 0
    _input_index: dict[str, TensorSpec] = field(init=False, repr=False, compare=False)
    _plan: tuple[
        tuple[str, np.dtype | None, int, tuple[int, ...] | None, tuple[tuple[int, int], ...]], ...
    ] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
        for kind, tensors in (("input", self.inputs), ("output", self.outputs)):
            names = [t.name for t in tensors]
            if not names:
                raise ValueError(f"a ModelSpec needs at least one {kind}")
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate {kind} names in {names}")
        object.__setattr__(self, "_input_index", {t.name: t for t in self.inputs})
        # Per input: name, dtype (None = BYTES), full rank, the non-batch dims when all are
        # fixed (else None), and (axis, size) of fixed dims; validate_inputs' fast path
        # checks exactly these.
        lead = 1 if self.batched else 0
        plan = tuple(
            (
                t.name,
                None if t.dtype.datatype == "BYTES" else t.dtype.numpy,
                len(t.shape) + lead,
                None if -1 in t.shape else t.shape,
                tuple((i + lead, d) for i, d in enumerate(t.shape) if d != -1),
            )
            for t in self.inputs
        )
        object.__setattr__(self, "_plan", plan)

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec:
        return self._input_index[name]

    def output(self, name: str) -> TensorSpec:
        for t in self.outputs:
            if t.name == name:
                return t
        raise KeyError(name)

    def validate_inputs(self, inputs: Mapping[str, np.ndarray]) -> int:
        """Check a request against the signature and return its batch size (1 if unbatched).

        Raises:
            InvalidInput: naming the tensor, what was expected and what was received.
        """
        # Fast path for well-formed requests; anything unusual takes the explaining path.
        if inputs.keys() == self._input_index.keys():
            rows = -1
            mbs = self.max_batch_size
            lead = 1 if mbs else 0
            for name, dtype, ndim, exact, fixed in self._plan:
                a = inputs[name]
                if type(a) is not np.ndarray or a.ndim != ndim:
                    break
                if dtype is None:
                    if a.dtype.kind not in "OS":
                        break
                elif a.dtype is not dtype and a.dtype != dtype:
                    break
                shape = a.shape
                if exact is not None:
                    if shape[lead:] != exact:
                        break
                elif not all(shape[axis] == size for axis, size in fixed):
                    break
                if mbs:
                    n = shape[0]
                    if n < 1 or n > mbs or (rows != -1 and n != rows):
                        break
                    rows = n
            else:
                return rows if mbs else 1
        return self._validate_slowly(inputs)

    def _validate_slowly(self, inputs: Mapping[str, np.ndarray]) -> int:
        if inputs.keys() != self._input_index.keys():
            self._raise_names(inputs)
        rows: int | None = None
        for spec in self.inputs:
            array = inputs[spec.name]
            if not isinstance(array, (np.ndarray, DeviceTensor)):
                raise InvalidInput(
                    f"input {spec.name!r}: expected a numpy array, got {type(array).__name__}"
                )
            if not spec.dtype_matches(array):
                got = as_dtype(array.dtype).datatype if array.dtype.kind != "V" else array.dtype
                raise InvalidInput(
                    f"input {spec.name!r}: expected dtype {spec.dtype.datatype}, got {got}"
                )
            rows = self._check_shape("input", spec, array.shape, rows, InvalidInput)
        return rows if rows is not None else 1

    def _raise_names(self, inputs: Mapping[str, np.ndarray]) -> None:
        expected = [t.name for t in self.inputs]
        missing = [name for name in expected if name not in inputs]
        if missing:
            raise InvalidInput(
                f"missing input(s) {missing}; expected {expected}, got {sorted(inputs)}"
            )
        unexpected = sorted(name for name in inputs if name not in self._input_index)
        raise InvalidInput(f"unexpected input(s) {unexpected}; expected {expected}")

    def check_outputs(self, outputs: Mapping[str, np.ndarray], rows: int) -> None:
        """Check what a runner returned for ``rows`` requests rows.

        Raises:
            RunnerError: an output is missing or its dtype, shape or row count is wrong.
        """
        for spec in self.outputs:
            if spec.name not in outputs:
                raise RunnerError(f"model returned no output {spec.name!r}; got {sorted(outputs)}")
            array = outputs[spec.name]
            if not isinstance(array, (np.ndarray, DeviceTensor)) or not spec.dtype_matches(array):
                got = getattr(array, "dtype", type(array).__name__)
                raise RunnerError(
                    f"output {spec.name!r}: expected dtype {spec.dtype.datatype}, got {got}"
                )
            got_rows = self._check_shape("output", spec, array.shape, None, RunnerError)
            if self.batched and got_rows != rows:
                raise RunnerError(
                    f"output {spec.name!r}: expected {rows} rows for {rows} input rows, got {got_rows}"
                )

    def _check_shape(
        self,
        kind: str,
        spec: TensorSpec,
        shape: tuple[int, ...],
        rows: int | None,
        error: type[Exception],
    ) -> int | None:
        expected = ((-1,) if self.batched else ()) + spec.shape
        if self.batched:
            if len(shape) != len(expected) or not spec.shape_matches(shape[1:]):
                raise error(
                    f"{kind} {spec.name!r}: expected shape {_fmt_shape(expected)} "
                    f"(batch dim first), got {_fmt_shape(shape)}"
                )
            n = shape[0]
            if n < 1:
                raise error(f"{kind} {spec.name!r}: batch size must be >= 1, got {n}")
            if n > self.max_batch_size:
                raise error(
                    f"{kind} {spec.name!r}: batch size {n} exceeds max_batch_size "
                    f"{self.max_batch_size}"
                )
            if rows is not None and n != rows:
                raise error(
                    f"{kind} {spec.name!r}: batch size {n} differs from the other inputs' {rows}"
                )
            return n
        if not spec.shape_matches(shape):
            raise error(
                f"{kind} {spec.name!r}: expected shape {_fmt_shape(expected)}, got {_fmt_shape(shape)}"
            )
        return rows

    def sample_inputs(
        self, batch_size: int = 1, rng: np.random.Generator | None = None, fill: int = 1
    ) -> dict[str, np.ndarray]:
        """Inputs that satisfy the signature (variable dims set to ``fill``); for warm-up and tests."""
        rng = rng or np.random.default_rng(0)
        out: dict[str, np.ndarray] = {}
        for spec in self.inputs:
            dims = tuple(fill if d == -1 else d for d in spec.shape)
            shape = ((batch_size,) if self.batched else ()) + dims
            if spec.dtype.datatype == "BYTES":
                out[spec.name] = np.full(shape, b"x", dtype=object)
            elif spec.dtype.numpy.kind == "f":
                out[spec.name] = rng.standard_normal(shape).astype(spec.dtype.numpy)
            elif spec.dtype.numpy.kind == "b":
                out[spec.name] = rng.integers(0, 2, shape).astype(np.bool_)
            else:
                out[spec.name] = rng.integers(0, 100, shape).astype(spec.dtype.numpy)
        return out


def spec_from_config(config: Mapping[str, Any]) -> ModelSpec:
    """The ``ModelSpec`` a Triton model config in its JSON form declares."""

    def tensors(items: list[Mapping[str, Any]]) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(t["name"], t["data_type"], [int(d) for d in t.get("dims", [])])
            for t in items
        )

    return ModelSpec(
        tensors(list(config.get("input", []))),
        tensors(list(config.get("output", []))),
        int(config.get("max_batch_size", 0)),
    )
