"""Tensors in and out of Triton's gRPC messages: a ``ModelInferRequest``'s inputs as
numpy (typed contents or raw bytes, or a shared-memory region), checked before anything
is allocated for them, and a ``ModelInferResponse`` carrying outputs as raw bytes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from ..device import on_host
from ..errors import InvalidInput
from ..protocol.cudashm import keep_outputs
from ..protocol.jsonbody import integer_tensor
from ..protocol.kserve import check_datatype, element_count, tensor_from_raw, tensor_to_raw
from ..protocol.shm import Regions, ShmRef, served, shm_ref, write_output
from ..spec import as_dtype
from .calls import Parts, bytes_field

RAW_OUTPUT_CONTENTS = 6
"""``ModelInferResponse.raw_output_contents``' field number."""
RAW_INPUT_CONTENTS = 7
"""``ModelInferRequest.raw_input_contents``' field number."""


class ModelInferRequest:
    """Triton's ``ModelInferRequest`` whose ``raw_input_contents`` are views of the message it was
    read from: protobuf parses the rest (names, shapes, parameters) and never copies the
    tensors' bytes (a 600 KB image twice: into the message, then out of it)."""

    __slots__ = ("_message", "raw_input_contents")

    def __init__(self, message: Any, raw: list[memoryview]) -> None:
        self._message, self.raw_input_contents = message, raw

    @classmethod
    def FromString(cls, data: bytes | memoryview) -> ModelInferRequest:  # noqa: N802 (protobuf's)
        """Raises ``DecodeError`` as protobuf does for a message it cannot read."""
        view = memoryview(data)
        raw: list[memoryview] = []
        rest: list[memoryview] = []
        pos, end = 0, len(view)
        while pos < end:
            start = pos
            key, pos = _varint(view, pos)
            kind = key & 7
            if kind == 0:
                _, pos = _varint(view, pos)
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            elif kind == 2:
                length, pos = _varint(view, pos)
                if key >> 3 == RAW_INPUT_CONTENTS and pos + length <= end:
                    raw.append(view[pos : pos + length])
                    pos += length
                    continue
                pos += length
            else:
                raise DecodeError(f"wire type {kind} at byte {start}")
            if pos > end:
                raise DecodeError("a field runs past the end of the message")
            rest.append(view[start:pos])
        return cls(service_pb2.ModelInferRequest.FromString(b"".join(rest)), raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._message, name)


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise DecodeError("a truncated or overlong varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


__all__ = [
    "ModelInferRequest",
    "decode_inputs", "infer_response", "output_refs", "parameter", "raw_view", "request_parameters",
]  # fmt: skip

_CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
"""Datatype -> the ``InferTensorContents`` field that carries it (FP16/BF16: raw only)."""
_NARROW = frozenset({"INT8", "INT16", "UINT8", "UINT16"})
"""Datatypes narrower than the contents field that carries them."""


def parameter(value: Any) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else None


def request_parameters(request: Any) -> dict[str, Any]:
    """The request's ``parameters`` map as plain values (what the HTTP JSON carries)."""
    return {key: parameter(value) for key, value in request.parameters.items()}


def output_refs(request: Any) -> dict[str, ShmRef]:
    """The outputs a ``ModelInferRequest`` asks for in shared memory, and where."""
    refs = {o.name: _shm(o, f"output {o.name!r}") for o in request.outputs if o.parameters}
    return {name: ref for name, ref in refs.items() if ref is not None}


def _shm(tensor: Any, what: str) -> ShmRef | None:
    """The tensor's shared-memory reference, if its parameters name a region."""
    if not tensor.parameters:
        return None
    return shm_ref({k: parameter(v) for k, v in tensor.parameters.items()}, what)


def decode_inputs(
    request: Any, size: int | None = None, regions: Regions | None = None
) -> dict[str, np.ndarray]:
    """The request's input tensors, checked before anything is allocated for them;
    ``size``: the message's size in bytes, where the caller has it; ``regions``: where
    inputs in shared memory are read (none taken without it)."""
    available = request.ByteSize() if size is None else size
    raw = list(request.raw_input_contents)
    refs = [_shm(t, f"input {t.name!r}") for t in request.inputs]
    sent = sum(ref is None for ref in refs)  # raw contents come for these only, in order
    if raw and len(raw) != sent:
        raise InvalidInput(
            f"raw_input_contents has {len(raw)} entries for {sent} inputs not in shared memory"
        )
    inputs: dict[str, np.ndarray] = {}
    position = 0
    for i, tensor in enumerate(request.inputs):
        name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
        if not name:
            raise InvalidInput(f"inputs[{i}] needs a name")
        if name in inputs:
            raise InvalidInput(f"input {name!r} appears twice")
        check_datatype(name, datatype)
        if any(d < 0 for d in shape):
            raise InvalidInput(f"input {name!r}: shape {shape} has a negative dimension")
        ref, typed = refs[i], tensor.HasField("contents")
        if ref is not None:
            if typed:
                raise InvalidInput(
                    f"input {name!r}: 'contents' given, but its data is in shared-memory "
                    f"region {ref.region!r}: send one or the other"
                )
            element_count(shape, name, ref.byte_size)
            inputs[name] = served(regions, ref, name).tensor(ref, name, datatype, shape)
            continue
        count = element_count(shape, name, available)
        if raw:
            if typed:
                raise InvalidInput(
                    f"input {name!r}: 'contents' given with raw_input_contents: send one or "
                    "the other"
                )
            data = memoryview(raw[position])
            position += 1
            inputs[name] = tensor_from_raw(name, datatype, shape, data, count)
            continue
        field = _CONTENTS.get(datatype)
        if field is None:
            raise InvalidInput(f"input {name!r}: {datatype} travels in raw_input_contents only")
        stray = [f.name for f, _ in tensor.contents.ListFields() if f.name != field]
        if stray:  # Triton refuses them too; taking only ``field`` would drop them unsaid
            raise InvalidInput(
                f"input {name!r}: a {datatype} tensor's values go in contents.{field}, "
                f"got contents.{stray[0]}"
            )
        values = getattr(tensor.contents, field)
        if len(values) != count:
            raise InvalidInput(
                f"input {name!r}: shape {shape} needs {count} values, contents has {len(values)}"
            )
        if datatype == "BYTES":
            array = np.empty(count, dtype=object)
            array[:] = list(values)
        elif datatype in _NARROW:  # an INT8 travels as int32s: 300 must not wrap to 44
            array = integer_tensor(values, datatype, name, field)
        else:
            array = np.asarray(values, dtype=as_dtype(datatype).numpy)
        inputs[name] = array.reshape(shape)
    if any(refs):  # inputs in shared memory: answered on the device if all outputs go there
        classified = any("classification" in o.parameters for o in request.outputs)
        wanted = () if classified else [o.name for o in request.outputs]
        keep_outputs(regions, inputs, wanted, output_refs(request))
    return inputs


def infer_response(
    request: Any,
    outputs: Mapping[str, np.ndarray],
    wanted: list[str],
    version: str,
    regions: Regions | None = None,
    final: bool | None = None,
) -> Parts:
    """The ``ModelInferResponse`` carrying ``wanted`` of ``outputs`` as raw bytes, or
    written into the shared-memory region the request names for one (``regions``; its
    raw contents then empty, so the others keep their places). Serialized in pieces: the
    raw contents are views of the output arrays, sent without a copy. ``final``: a
    decoupled model's ``triton_final_response`` parameter."""
    response = service_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=version, id=request.id
    )
    if final is not None:
        response.parameters["triton_final_response"].bool_param = final
    refs = output_refs(request)
    contents: list[bytes | memoryview] = []
    for out in wanted:
        if out not in outputs:
            raise InvalidInput(
                f"requested output {out!r}: {request.model_name} has {sorted(outputs)}"
            )
        array = outputs[out]
        response.outputs.add(
            name=out, datatype=as_dtype(array.dtype).datatype, shape=list(array.shape)
        )
        ref = refs.get(out)
        if ref is not None:
            # No parameters, as tritonserver answers it: the client named the region.
            write_output(served(regions, ref, out), ref, out, array)
            contents += bytes_field(RAW_OUTPUT_CONTENTS, b"")
        else:
            contents += bytes_field(RAW_OUTPUT_CONTENTS, raw_view(on_host(array)))
    return Parts([response.SerializeToString(), *contents])


def raw_view(array: np.ndarray) -> bytes | memoryview:
    """An output's raw bytes as ``tensor_to_raw`` lays them out, as a view of the array
    where it is contiguous already (no copy)."""
    if array.dtype != object and array.flags.c_contiguous:
        return memoryview(array.reshape(-1)).cast("B")  # type: ignore[arg-type]
    return tensor_to_raw(array)[1]
