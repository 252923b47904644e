"""The KServe v2 inference protocol's HTTP/REST encoding: requests in, responses out.

JSON tensors (``data`` as a flat or nested list) and Triton's binary tensor data
extension (``Inference-Header-Content-Length``: a JSON header, then each binary input's
bytes in order; BYTES elements as 4-byte little-endian length + bytes) both decode to
numpy; responses encode outputs as JSON, or as binary when the request asks for it
(``binary_data_output`` or an output's ``binary_data`` parameter), as tritonclient does.
Every malformed request raises ``InvalidInput`` naming what was wrong.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from ..device import on_host
from ..errors import InvalidInput
from ..spec import DTYPES, ModelSpec, as_dtype
from .cudashm import keep_outputs
from .jsonbody import json_body, json_tensor, parse_json
from .parameters import flag
from .shm import Regions, ShmRef, served, shm_ref, write_output

__all__ = [
    "DecodedRequest",
    "check_datatype",
    "classify",
    "decode_request",
    "element_count",
    "encode_response",
    "explicit_binary",
    "metadata",
    "parse_json",
    "raw_binary_request",
    "tensor_from_raw",
    "tensor_to_raw",
]

HEADER_LENGTH = "inference-header-content-length"
_DATATYPES = {d.datatype for d in DTYPES}
_NONE: frozenset[str] = frozenset()
_NO_PARAMETERS: Mapping[str, Any] = MappingProxyType({})
_DIMENSIONS = frozenset({int})
"""A dimension's one JSON type (``true`` is no 1 here, as in Triton)."""
MAX_RANK = 32
"""Dimensions a tensor may have (numpy's limit)."""


@dataclass(frozen=True)
class DecodedRequest:
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...] | None
    """Requested output names, or None for all."""
    binary_outputs: frozenset[str]
    """Outputs answered as binary; ``*`` for every output not in ``json_outputs``."""
    id: str | None
    parameters: Mapping[str, Any]
    json_outputs: frozenset[str] = frozenset()
    """Outputs whose own ``binary_data: false`` overrides ``binary_data_output``."""
    classification: Mapping[str, int] = field(default_factory=dict)
    """Output name -> k: answer the top k classes instead of the tensor (Triton's
    classification extension)."""
    shm_outputs: Mapping[str, ShmRef] = field(default_factory=dict)
    """Outputs to write into shared memory instead of the response."""
    regions: Regions | None = None
    """Where its shared-memory tensors lie (the server's ``SharedMemory``)."""


def _bytes_from_binary(raw: memoryview, count: int, name: str) -> np.ndarray:
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(raw):
            raise InvalidInput(f"input {name!r}: BYTES data ends inside element {i} of {count}")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise InvalidInput(
                f"input {name!r}: BYTES element {i} claims {n} bytes, only {len(raw) - pos} left"
            )
        out[i] = bytes(raw[pos : pos + n])
        pos += n
    if pos != len(raw):
        raise InvalidInput(
            f"input {name!r}: {len(raw) - pos} bytes left over after {count} BYTES elements"
        )
    return out


def _bytes_to_binary(array: np.ndarray) -> bytes:
    parts = []
    for item in array.reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    return b"".join(parts)


def tensor_from_raw(
    name: str, datatype: str, shape: list[int], raw: memoryview, count: int
) -> np.ndarray:
    """One input from its raw bytes (Triton's binary tensor layout: little-endian values,
    BYTES as 4-byte-length-prefixed elements); ``count`` is the checked element count."""
    if datatype == "BYTES":
        return _bytes_from_binary(raw, count, name).reshape(shape)
    dtype = as_dtype(datatype).numpy
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {name!r}: shape {shape} of {datatype} needs {count * dtype.itemsize} bytes, "
            f"got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def tensor_to_raw(array: np.ndarray) -> tuple[str, bytes]:
    """An output's KServe datatype and raw bytes (the layout ``tensor_from_raw`` reads)."""
    datatype = as_dtype(array.dtype).datatype
    if datatype == "BYTES":
        return datatype, _bytes_to_binary(array)
    return datatype, np.ascontiguousarray(array).tobytes()


def check_datatype(name: str, datatype: object) -> str:
    """A KServe datatype name, or ``InvalidInput`` naming the tensor and the known ones."""
    if not isinstance(datatype, str) or datatype not in _DATATYPES:
        raise InvalidInput(
            f"input {name!r}: unknown datatype {datatype!r}; expected one of {sorted(_DATATYPES)}"
        )
    return datatype


def element_count(shape: list[int], name: str, available: int) -> int:
    """Public name of ``_element_count`` (the gRPC service checks claims the same way)."""
    return _element_count(shape, name, available)


def _element_count(shape: list[int], name: str, available: int) -> int:
    """Elements a shape claims, checked before anything is allocated for them: every
    element takes at least one byte of the request, so a claim beyond the body's size
    (``[100000000, 3, 224, 224]`` with ``"data": [0.0]``) is refused, not allocated."""
    count = math.prod(shape)  # Python ints: no overflow
    if count > available:
        raise InvalidInput(
            f"input {name!r}: shape {shape} claims {count} elements, "
            f"more than the {available}-byte request can hold"
        )
    return count


def _parameters(obj: Mapping[str, Any], what: str, name: str | None = None) -> Mapping[str, Any]:
    """``obj``'s ``parameters`` object; ``what`` (and ``name``) say whose in an error."""
    params = obj.get("parameters")
    if params is None:
        return _NO_PARAMETERS
    if not isinstance(params, dict):
        whose = what if name is None else f"{what} {name!r}"
        raise InvalidInput(f"{whose}: 'parameters' must be an object, got {type(params).__name__}")
    return params


def decode_request(
    body: bytes, header_length: int | None = None, regions: Regions | None = None
) -> DecodedRequest:
    """Decode an infer request body (JSON, or JSON header + binary tensors)."""
    header_bytes = body if header_length is None else body[:header_length]
    if header_length is not None and not 0 < header_length <= len(body):
        raise InvalidInput(
            f"Inference-Header-Content-Length {header_length} does not fit a {len(body)}-byte body"
        )
    header = json_body(header_bytes)
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise InvalidInput("request must be a JSON object with an 'inputs' list")
    binary = memoryview(body)[header_length:] if header_length is not None else memoryview(b"")
    pos = 0
    inputs: dict[str, np.ndarray] = {}
    for i, item in enumerate(header["inputs"]):
        if not isinstance(item, dict):
            raise InvalidInput(f"inputs[{i}] must be an object")
        name, datatype, shape = item.get("name"), item.get("datatype"), item.get("shape")
        if not isinstance(name, str) or not name:
            raise InvalidInput(f"inputs[{i}] needs a 'name'")
        datatype = check_datatype(name, datatype)
        if not isinstance(shape, list) or not (
            set(map(type, shape)) <= _DIMENSIONS and min(shape, default=0) >= 0
        ):
            raise InvalidInput(
                f"input {name!r}: 'shape' must be a list of non-negative integers, got {shape!r}"
            )
        if len(shape) > MAX_RANK:
            raise InvalidInput(
                f"input {name!r}: shape has {len(shape)} dimensions; at most {MAX_RANK} are supported"
            )
        if name in inputs:
            raise InvalidInput(f"input {name!r} appears twice")
        params = _parameters(item, "input", name)
        size = params.get("binary_data_size")
        ref = shm_ref(params, f"input {name!r}")
        if ref is not None:
            _element_count(shape, name, ref.byte_size)
            inputs[name] = served(regions, ref, name).tensor(ref, name, datatype, shape)
            continue
        count = _element_count(shape, name, len(body))
        if size is not None:
            if type(size) is not int or size < 0:
                raise InvalidInput(
                    f"input {name!r}: binary_data_size must be a non-negative integer, got {size!r}"
                )
            if pos + size > len(binary):
                raise InvalidInput(
                    f"input {name!r}: binary_data_size {size!r} exceeds the {len(binary) - pos} binary bytes left"
                )
            inputs[name] = tensor_from_raw(name, datatype, shape, binary[pos : pos + size], count)
            pos += size
        elif "data" in item:
            inputs[name] = json_tensor(item["data"], datatype, shape, name, count)
        else:
            raise InvalidInput(f"input {name!r} has neither 'data' nor binary_data_size")
    if pos != len(binary):
        raise InvalidInput(f"{len(binary) - pos} binary bytes after the last input")
    parameters = _parameters(header, "request")
    if parameters:
        reserved = sorted(k for k in parameters if k.startswith("triton_"))
        if reserved:
            raise InvalidInput(f"request parameters {reserved} are reserved (triton_*)")
    requested = header.get("outputs")
    names: tuple[str, ...] | None = None
    binary_out: set[str] = {"*"} if flag(parameters, "binary_data_output", "request") else set()
    json_out: set[str] = set()
    classification: dict[str, int] = {}
    shm_outputs: dict[str, ShmRef] = {}
    if requested is not None:
        if not isinstance(requested, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in requested
        ):
            raise InvalidInput("'outputs' must be a list of objects with a 'name' string")
        names = tuple(o["name"] for o in requested)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidInput(f"output(s) {twice} requested more than once")
        for o in requested:
            params = _parameters(o, "output", o["name"])
            if "binary_data" in params:  # an output's own choice wins over the request's
                own = flag(params, "binary_data", f"output {o['name']!r}")
                (binary_out if own else json_out).add(o["name"])
            ref = shm_ref(params, f"output {o['name']!r}")
            if ref is not None:
                if o["name"] in binary_out:  # tritonserver's 400, in its words
                    raise InvalidInput(
                        "Output can't set both 'shared_memory_region' and 'binary_data'"
                    )
                served(regions, ref, o["name"])
                shm_outputs[o["name"]] = ref
            k = params.get("classification")
            if k is not None:
                if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                    raise InvalidInput(
                        f"output {o['name']!r}: classification expects a count >= 1, got {k!r}"
                    )
                classification[o["name"]] = k
    keep_outputs(regions, inputs, () if classification else names or (), shm_outputs)
    return DecodedRequest(
        inputs,
        names,
        frozenset(binary_out) if binary_out else _NONE,
        header.get("id"),
        parameters,
        frozenset(json_out) if json_out else _NONE,
        classification,
        shm_outputs,
        regions,
    )


def explicit_binary(
    body: bytes, header_length: int | None, request: DecodedRequest
) -> tuple[bytes, int | None]:
    """The body with ``binary_data_output`` spelled out per output when an output's own
    ``binary_data: false`` overrides it, for a server behind that gets the precedence
    wrong (tritonserver answers such an output binary); otherwise the body as it is."""
    if not (request.json_outputs and "*" in request.binary_outputs):
        return body, header_length
    header = json.loads(body[:header_length] if header_length else body)
    del header["parameters"]["binary_data_output"]
    for output in header["outputs"]:
        params = output.setdefault("parameters", {})
        params["binary_data"] = output["name"] not in request.json_outputs
    rewritten = json.dumps(header, separators=(",", ":")).encode()
    if not header_length:
        return rewritten, None
    return rewritten + body[header_length:], len(rewritten)


def raw_binary_request(spec: ModelSpec, body: bytes) -> DecodedRequest:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``): the body is
    the raw bytes of the model's only input, whose shape comes from the model (rows of
    it, for a batched model; one element, for BYTES)."""
    if len(spec.inputs) != 1:
        raise InvalidInput(
            f"a raw binary request needs a model with one input; this one has "
            f"{[t.name for t in spec.inputs]}"
        )
    (tensor,) = spec.inputs
    lead = [1] if spec.batched else []
    if tensor.dtype.datatype == "BYTES":
        if math.prod(tensor.shape) != 1:
            raise InvalidInput(
                f"input {tensor.name!r}: a raw BYTES body is one element; the input takes "
                f"shape {list(tensor.shape)}"
            )
        array = np.empty([*lead, *(1 for _ in tensor.shape)], dtype=object)
        array.reshape(-1)[0] = bytes(body)
        return DecodedRequest({tensor.name: array}, None, frozenset(), None, {})
    if any(d < 0 for d in tensor.shape):
        raise InvalidInput(
            f"input {tensor.name!r}: a raw binary request needs a fixed shape, the input has "
            f"{list(tensor.shape)}"
        )
    row = math.prod(tensor.shape) * tensor.dtype.numpy.itemsize
    rows = len(body) // row if spec.batched and row else 1
    if rows < 1 or rows * row != len(body):
        raise InvalidInput(
            f"input {tensor.name!r}: a raw body of {len(body)} bytes is not "
            f"{'a whole number of rows' if spec.batched else 'one tensor'} of "
            f"{list(tensor.shape)} {tensor.dtype.datatype} ({row} bytes each)"
        )
    shape = [rows, *tensor.shape] if spec.batched else list(tensor.shape)
    array = np.frombuffer(body, dtype=tensor.dtype.numpy).reshape(shape)
    return DecodedRequest({tensor.name: array}, None, frozenset(), None, {})


def encode_response(
    model: str, outputs: Mapping[str, np.ndarray], request: DecodedRequest, version: str = "1"
) -> tuple[bytes, dict[str, str]]:
    """Response body and headers; binary outputs follow the JSON header when requested."""
    wanted = request.outputs if request.outputs is not None else tuple(outputs)
    unknown = [n for n in wanted if n not in outputs]
    if unknown:
        raise InvalidInput(f"unknown output(s) {unknown} requested; {model} has {sorted(outputs)}")
    entries, tails = [], []
    for name in wanted:
        array = outputs[name]
        if name in request.classification:
            array = classify(on_host(array), request.classification[name], name)
        datatype = as_dtype(array.dtype).datatype
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        ref = request.shm_outputs.get(name)
        if ref is not None and request.regions is not None:
            # As tritonserver answers it: name, datatype and shape alone. NVIDIA's C++
            # client reads an output's "parameters" as its binary_data_size and refuses
            # the answer without one.
            write_output(request.regions, ref, name, array)
            entries.append(entry)
            continue
        array = on_host(array)
        binary = name in request.binary_outputs or (
            "*" in request.binary_outputs and name not in request.json_outputs
        )
        if binary:
            _, raw = tensor_to_raw(array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            tails.append(raw)
        elif datatype == "BYTES":
            entry["data"] = [
                v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)
                for v in array.reshape(-1)
            ]
        else:
            entry["data"] = array.reshape(-1).tolist()
        entries.append(entry)
    body: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        body["id"] = request.id
    header = json.dumps(body, separators=(",", ":")).encode()
    if not tails:
        return header, {"content-type": "application/json"}
    return header + b"".join(tails), {
        "content-type": "application/octet-stream",
        HEADER_LENGTH: str(len(header)),
    }


def classify(array: np.ndarray, k: int, name: str) -> np.ndarray:
    """Triton's classification extension: the top ``k`` of each row's last axis as BYTES
    ``"<value>:<index>"``, highest first ([batch, k] for [batch, classes])."""
    if array.dtype == object or array.ndim == 0:
        raise InvalidInput(f"output {name!r}: classification needs a numeric tensor")
    scores = array.reshape(-1, array.shape[-1]) if array.ndim > 1 else array.reshape(1, -1)
    k = min(k, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    out = np.empty((scores.shape[0], k), dtype=object)
    for r, row in enumerate(top):
        out[r] = [f"{float(scores[r, i]):f}:{int(i)}".encode() for i in row]
    return out.reshape((*array.shape[:-1], k)) if array.ndim > 1 else out.reshape(k)


def metadata(
    name: str, spec: ModelSpec, versions: Sequence[str] = ("1",), platform: str = "servekit"
) -> dict[str, Any]:
    """``GET /v2/models/{name}``: tensors with the batch dim as -1, as Triton reports them."""
    lead = [-1] if spec.batched else []

    def tensors(items: Sequence[Any]) -> list[dict[str, Any]]:
        return [
            {"name": t.name, "datatype": t.dtype.datatype, "shape": lead + list(t.shape)}
            for t in items
        ]

    return {
        "name": name,
        "versions": list(versions),
        "platform": platform,
        "inputs": tensors(spec.inputs),
        "outputs": tensors(spec.outputs),
    }
