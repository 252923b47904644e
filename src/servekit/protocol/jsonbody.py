"""JSON in the KServe v2 HTTP encoding: request bodies, and tensors sent as ``data``.

Each JSON value must be of the tensor's kind, as tritonserver reads it: numbers for FP16,
FP32 and FP64, integers within the datatype's range for INT* and UINT*, ``true`` and
``false`` for BOOL, strings for BYTES. numpy would otherwise take ``true`` as 1.0 in an
FP32, ``1.5`` as 1 in an INT32 and ``-1`` as 255 in a UINT8: such a value is refused
naming the input, the datatype and the value, as is a number too big for a double
(``1e400``, which Python reads as infinity) or for an FP16 (``70000``; tritonserver takes
no FP16 in JSON at all). ``1e39`` in an FP32 is infinity, as tritonserver's cast makes it;
``NaN`` and ``Infinity`` are taken, as tritonserver takes them, and answered the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from ..errors import InvalidInput
from ..spec import as_dtype

__all__ = ["MAX_JSON_DEPTH", "integer_tensor", "json_body", "json_tensor", "parse_json"]

MAX_JSON_DEPTH = 100
"""How deep a request's JSON may nest, as in Triton: an input's ``data`` is flattened at any
nesting up to this depth (Triton's QA sends it 50 deep), whatever the tensor's rank."""

_FLOATS = frozenset({int, float})
_INTEGERS = frozenset({int})
_BOOLS = frozenset({bool})
_BOUNDS = {
    np.dtype(t): (int(np.iinfo(t).min), int(np.iinfo(t).max))
    for t in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
}
"""Each integer dtype's range, looked up per request (``np.iinfo`` costs microseconds)."""


def _kinds(datatype: str) -> tuple[frozenset[type], str]:
    """The JSON types a tensor of ``datatype`` takes, and how an error names them."""
    if datatype == "BOOL":
        return _BOOLS, "true or false"
    if datatype.startswith(("INT", "UINT")):
        return _INTEGERS, "an integer"
    return _FLOATS, "a number"


class _Unfit(str):
    """A JSON number no double holds (``1e400``; Python would read infinity), kept as its
    text so that the tensor it is in is named in the refusal."""


def _double(text: str) -> float | _Unfit:
    """A JSON number with a fraction or exponent; ``_Unfit`` where no double holds it."""
    value = float(text)
    return _Unfit(text[:40]) if value in (float("inf"), float("-inf")) else value


def json_body(data: bytes, what: str = "request") -> Any:
    """A JSON body (``what`` names it in errors): orjson's parse, or, for what orjson
    refuses (NaN, Infinity, deep nesting, huge numbers, bad JSON), Python's json, which
    decides and says why."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data, parse_float=_double)
    except RecursionError:
        raise InvalidInput(f"{what} JSON is nested too deeply") from None
    except ValueError as exc:  # bad JSON, bad UTF-8, an integer of over 4,300 digits
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None


def parse_json(body: bytes, what: str) -> Any:
    """A JSON request body other than an infer request's (the repository index's), parsed
    with the same limits: valid JSON nested at most ``MAX_JSON_DEPTH`` deep."""
    data = json_body(body, what)
    level, depth = [data], 1
    while level:
        level = [
            v
            for c in level
            if isinstance(c, list | dict)
            for v in (c.values() if isinstance(c, dict) else c)
            if isinstance(v, list | dict)
        ]
        if level:
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise InvalidInput(f"{what}: JSON nested more than {MAX_JSON_DEPTH} levels deep")
    return data


def _flatten(data: list[Any], name: str) -> tuple[list[Any], set[type]]:
    """The values of a nested list, level by level (no recursion, no numpy dimension
    limit), and their types; nesting deeper than ``MAX_JSON_DEPTH`` is refused."""
    flat, depth = data, 1
    kinds = set(map(type, flat))  # JSON gives exact types: a set of them is C-fast
    while list in kinds:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            raise InvalidInput(
                f"input {name!r}: 'data' is nested more than {MAX_JSON_DEPTH} levels deep"
            )
        flat = [x for v in flat for x in (v if isinstance(v, list) else (v,))]
        kinds = set(map(type, flat))
    return flat, kinds


def integer_tensor(values: Sequence[int], datatype: str, name: str, where: str) -> np.ndarray:
    """Integers as an INT* or UINT* tensor, each within the datatype's range (numpy would
    wrap ``-1`` to 255 in a UINT8): read as int64s, the bounds checked at C speed, or
    else one by one; ``InvalidInput`` names the first value outside and ``where`` it was."""
    dtype = as_dtype(datatype).numpy
    if not len(values):
        return np.empty(0, dtype)
    low, high = _BOUNDS[dtype]
    if dtype != np.uint64:
        try:
            wide = np.asarray(values, dtype=np.int64)
        except OverflowError:  # past 64 bits: named below
            wide = None
        if wide is not None and low <= wide.min() and wide.max() <= high:
            return wide.astype(dtype, copy=False)
    bad = next((v for v in (min(values), max(values)) if not low <= v <= high), None)
    if bad is not None:
        raise InvalidInput(
            f"input {name!r}: {where} is not {datatype}: {bad} is outside [{low}, {high}]"
        )
    return np.asarray(values, dtype=dtype)


def json_tensor(data: Any, datatype: str, shape: list[int], name: str, count: int) -> np.ndarray:
    """An input's ``data`` as a tensor of ``shape`` (``count`` values, checked already
    against the body's size)."""
    if not isinstance(data, list):
        raise InvalidInput(f"input {name!r}: 'data' must be a list, got {type(data).__name__}")
    flat, kinds = _flatten(data, name)
    if len(flat) != count:
        raise InvalidInput(
            f"input {name!r}: shape {shape} needs {count} values, 'data' has {len(flat)}"
        )
    if datatype == "BYTES":
        if not kinds <= {str}:
            raise InvalidInput(f"input {name!r}: BYTES 'data' must hold strings")
        out = np.empty(count, dtype=object)
        out[:] = [v.encode() for v in flat]
        return out.reshape(shape)
    dtype = as_dtype(datatype).numpy
    allowed, what = _kinds(datatype)
    if not kinds <= allowed:
        bad = next(v for v in flat if type(v) not in allowed)
        held = (
            f"the number {bad} does not fit a double (64-bit float)"
            if type(bad) is _Unfit
            else f"it holds {json.dumps(bad)}, not {what}"
        )
        raise InvalidInput(f"input {name!r}: 'data' is not {datatype}: {held}")
    if allowed is _INTEGERS:
        return integer_tensor(flat, datatype, name, "'data'").reshape(shape)
    try:
        if dtype != np.float16:
            return np.asarray(flat, dtype=dtype).reshape(shape)
        with np.errstate(over="raise"):  # 70000 would be inf, not an FP16
            return np.asarray(flat, dtype=dtype).reshape(shape)
    except FloatingPointError:
        top = float(np.finfo(dtype).max)
        bad = next((v for v in flat if top < abs(v) < float("inf")), "a value")
        raise InvalidInput(
            f"input {name!r}: 'data' is not {datatype}: {bad} is outside [-{top:g}, {top:g}]"
        ) from None
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInput(f"input {name!r}: 'data' is not {datatype}: {exc}") from None
