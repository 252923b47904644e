"""``servekit bench --input-data``: the tensors a bench sends, as perf_analyzer takes them.

``zero`` (zeros), ``random`` or ``random:LOW:HIGH`` (uniform in that closed range; plain
``random`` keeps the bench's default: normal floats, integers in 0..99, JPEGs for BYTES),
a JSON file in perf_analyzer's "real input data" format, or a folder with one raw file
per input. ``--shape NAME:D1,D2`` fills the variable dimensions of an input, batch
dimension excluded (perf_analyzer's ``--shape``). Each JSON entry is one row; a request of
``batch_size`` rows stacks that many consecutive entries, and the bench cycles through
the requests so formed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..spec import as_dtype
from .payload import payload_from_metadata

__all__ = ["InputDataError", "load_input_data", "parse_shapes"]

Payload = dict[str, np.ndarray]


class InputDataError(ValueError):
    """``--input-data`` or ``--shape`` cannot give the model's inputs: the message says why."""


def parse_shapes(specs: Sequence[str]) -> dict[str, list[int]]:
    """``["IN:3,224", ...]`` as ``{"IN": [3, 224]}`` (``--shape``, batch dimension excluded)."""
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        name, sep, dims = spec.rpartition(":")
        try:
            shape = [int(d) for d in dims.split(",")] if dims else []
        except ValueError:
            shape = [-1]
        if not sep or not name or any(d < 0 for d in shape):
            raise InputDataError(f"--shape {spec!r}: use NAME:D1,D2 with dims >= 0")
        shapes[name] = shape
    return shapes


def load_input_data(
    source: str,
    inputs: Sequence[Mapping[str, Any]],
    batch_size: int = 1,
    shapes: Mapping[str, Sequence[int]] | None = None,
    images: Sequence[bytes] = (),
) -> list[Payload]:
    """The requests a bench sends (at least one) for a model's KServe v2 metadata ``inputs``.

    Raises:
        InputDataError: the source names no file, a file is malformed, an input is missing
            or its content does not fit its shape; the message names the input.
    """
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {spec["name"] for spec in inputs})
    if unknown:
        raise InputDataError(f"--shape names no input of the model: {', '.join(unknown)}")
    if source == "zero" or source.startswith("random"):
        return [_generated(source, inputs, batch_size, shapes, images)]
    path = Path(source)
    if path.is_dir():
        rows = [_from_folder(path, inputs, shapes)]
    elif path.is_file():
        rows = _from_json(path, inputs, shapes)
    else:
        raise InputDataError(
            f"--input-data {source!r}: neither zero, random[:LOW:HIGH], a JSON file nor a folder"
        )
    if not all(_batched(spec) for spec in inputs):  # each row is a whole request
        if batch_size != 1:
            raise InputDataError("the model does not batch: --batch-size must be 1")
        return rows
    # Each request stacks batch_size consecutive rows; enough requests to use every row.
    count = max(1, -(-len(rows) // batch_size))
    return [
        {
            name: np.stack(
                [rows[(r * batch_size + i) % len(rows)][name] for i in range(batch_size)]
            )
            for name in rows[0]
        }
        for r in range(count)
    ]


def _batched(spec: Mapping[str, Any]) -> bool:
    """Whether an input's leading dimension is the batch (-1), as the bench's payloads read it."""
    return bool(spec["shape"]) and int(spec["shape"][0]) == -1


def _row_shape(spec: Mapping[str, Any], shapes: Mapping[str, Sequence[int]]) -> list[int]:
    """An input's shape without its batch dimension, its variable dims from ``--shape``."""
    name, dims = spec["name"], [int(d) for d in spec["shape"]]
    dims = dims[1:] if _batched(spec) else dims
    given = shapes.get(name)
    if given is not None:
        if len(given) != len(dims) or any(
            d not in (-1, g) for d, g in zip(dims, given, strict=True)
        ):
            raise InputDataError(
                f"--shape {name}:{','.join(map(str, given))} does not fit the model's "
                f"{dims} (batch dimension excluded)"
            )
        return list(given)
    return dims


def _generated(
    source: str,
    inputs: Sequence[Mapping[str, Any]],
    batch_size: int,
    shapes: Mapping[str, Sequence[int]],
    images: Sequence[bytes],
) -> Payload:
    sized = [
        {**spec, "shape": [-1] * _batched(spec) + _row_shape(spec, shapes)}
        if spec["name"] in shapes
        else spec
        for spec in inputs
    ]
    if source == "random":
        return payload_from_metadata(sized, batch_size, images=images)
    low = high = 0.0
    if source != "zero":
        try:
            _, lo, hi = source.split(":")
            low, high = float(lo), float(hi)
        except ValueError:
            raise InputDataError(
                f"--input-data {source!r}: random takes a range as random:LOW:HIGH"
            ) from None
        if not low <= high:
            raise InputDataError(f"--input-data {source!r}: LOW must be <= HIGH")
    rng = np.random.default_rng(0)
    out: Payload = {}
    for spec in sized:
        dims = [int(d) for d in spec["shape"]]
        shape = [batch_size if i == 0 and d == -1 else max(d, 1) for i, d in enumerate(dims)]
        dtype = as_dtype(spec["datatype"])
        if dtype.datatype == "BYTES":
            count = int(np.prod(shape))
            array = np.empty(count, dtype=object)
            array[:] = (
                [b"0"] * count
                if source == "zero"
                else [f"{v:g}".encode() for v in rng.uniform(low, high, count)]
            )
            out[spec["name"]] = array.reshape(shape)
        elif dtype.numpy.kind in "iub":
            out[spec["name"]] = rng.integers(int(low), int(high), shape, endpoint=True).astype(
                dtype.numpy
            )
        else:
            out[spec["name"]] = rng.uniform(low, high, shape).astype(dtype.numpy)
    return out


def _fit(name: str, flat: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``flat`` (row-major) as one row of ``shape``; the one variable dim, if any, inferred."""
    dims = list(shape)
    if dims.count(-1) > 1:
        raise InputDataError(
            f"input {name!r}: its shape {dims} has several variable dims: give --shape {name}:..."
        )
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        if known == 0 or flat.size % known:
            raise InputDataError(f"input {name!r}: {flat.size} values do not fill {dims}")
        dims[dims.index(-1)] = flat.size // known
    if int(np.prod(dims)) != flat.size:
        raise InputDataError(f"input {name!r}: {flat.size} values, but its shape {dims} holds "
                             f"{int(np.prod(dims))}")  # fmt: skip
    return flat.reshape(dims)


def _from_json(
    path: Path, inputs: Sequence[Mapping[str, Any]], shapes: Mapping[str, Sequence[int]]
) -> list[Payload]:
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputDataError(f"--input-data {path}: {exc}") from None
    entries = document.get("data") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputDataError(f'--input-data {path}: expected {{"data": [{{"INPUT": ...}}, ...]}}')
    rows = []
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise InputDataError(f"--input-data {path}: entry {n} is not an object of inputs")
        row: Payload = {}
        for spec in inputs:
            name = spec["name"]
            if name not in entry:
                raise InputDataError(f"--input-data {path}: entry {n} has no input {name!r}")
            row[name] = _json_tensor(name, entry[name], spec, shapes, f"{path} entry {n}")
        rows.append(row)
    return rows


def _json_tensor(
    name: str,
    value: Any,
    spec: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    where: str,
) -> np.ndarray:
    """One input of one entry: a flat list, ``{"content": [...], "shape": [...]}`` or
    ``{"b64": "..."}`` (raw bytes, row-major), as perf_analyzer reads them."""
    dtype = as_dtype(spec["datatype"])
    shape = _row_shape(spec, shapes)
    if isinstance(value, dict):
        if "shape" in value:
            shape = [int(d) for d in value["shape"]]
        if "b64" in value:
            if dtype.datatype == "BYTES":
                raise InputDataError(f"{where}: input {name!r} is BYTES: give its strings")
            raw = base64.b64decode(value["b64"])
            return _fit(name, np.frombuffer(raw, dtype.numpy).copy(), shape)
        if "content" not in value:
            raise InputDataError(f"{where}: input {name!r} needs content, b64 or a list")
        value = value["content"]
    if dtype.datatype == "BYTES":
        items = np.ravel(np.asarray(value, dtype=object))
        flat = np.empty(items.size, dtype=object)
        flat[:] = [v.encode() if isinstance(v, str) else bytes(v) for v in items]
    else:
        try:
            flat = np.ravel(np.asarray(value, dtype=dtype.numpy))
        except (TypeError, ValueError) as exc:
            raise InputDataError(f"{where}: input {name!r}: {exc}") from None
    return _fit(name, flat, shape)


def _from_folder(
    folder: Path, inputs: Sequence[Mapping[str, Any]], shapes: Mapping[str, Sequence[int]]
) -> Payload:
    """One row from ``folder/<input name>``: raw row-major bytes, or one string a line for
    BYTES (perf_analyzer's directory mode)."""
    row: Payload = {}
    for spec in inputs:
        name = spec["name"]
        file = folder / name
        if not file.is_file():
            raise InputDataError(f"--input-data {folder}: no file {name!r} for input {name!r}")
        dtype = as_dtype(spec["datatype"])
        if dtype.datatype == "BYTES":
            lines = file.read_bytes().splitlines()
            flat = np.empty(len(lines), dtype=object)
            flat[:] = lines
        else:
            raw = file.read_bytes()
            if len(raw) % dtype.numpy.itemsize:
                raise InputDataError(
                    f"{file}: {len(raw)} bytes is not a whole number of {dtype.datatype}"
                )
            flat = np.frombuffer(raw, dtype.numpy).copy()
        row[name] = _fit(name, flat, _row_shape(spec, shapes))
    return row
