"""What decides a model's answer, as one byte string: the cache's key and its check.

Triton's response cache hashes the model, its version, the input names and the input
bytes only, so two requests with the same bytes in another shape or datatype share an
answer, and a hash collision returns a wrong one. A ``Query`` holds everything that
decides the answer (the served version's identity, every input's name, datatype, shape
and bytes, the parameters that change the answer and the outputs asked for); ``encode``
writes it canonically (names sorted, every field length-prefixed, so no two queries
encode alike), the key is a digest of that, and a hit is returned only when the stored
query's encoding equals the new one's, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Query", "decode_tensors", "encode_tensors"]


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _tensor_bytes(array: np.ndarray) -> tuple[str, bytes]:
    """A tensor's datatype and contents (BYTES tensors: each element length-prefixed)."""
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        items = [x if isinstance(x, bytes) else str(x).encode() for x in array.reshape(-1)]
        return "BYTES", b"".join(_field(x) for x in items)
    return array.dtype.str, np.ascontiguousarray(array).tobytes()


def encode_tensors(tensors: Mapping[str, np.ndarray]) -> bytes:
    """Named tensors as bytes, names sorted: name, datatype, shape, contents."""
    out = [_field(str(len(tensors)).encode())]
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        dtype, data = _tensor_bytes(array)
        shape = ",".join(str(d) for d in array.shape).encode()
        out += [_field(name.encode()), _field(dtype.encode()), _field(shape), _field(data)]
    return b"".join(out)


def _fields(blob: bytes) -> list[bytes]:
    fields, at = [], 0
    while at < len(blob):
        (n,) = struct.unpack_from("<Q", blob, at)
        fields.append(blob[at + 8 : at + 8 + n])
        at += 8 + n
    return fields


def decode_tensors(blob: bytes) -> dict[str, np.ndarray]:
    """``encode_tensors``' inverse."""
    fields = _fields(blob)
    out: dict[str, np.ndarray] = {}
    for k in range(int(fields[0])):
        name, dtype, shape_text, data = fields[1 + 4 * k : 5 + 4 * k]
        shape = tuple(int(d) for d in shape_text.decode().split(",") if d)
        if dtype == b"BYTES":
            out[name.decode()] = np.array(_fields(data), dtype=np.object_).reshape(shape)
        else:
            out[name.decode()] = np.frombuffer(data, dtype=np.dtype(dtype.decode())).reshape(shape)
    return out


@dataclass(frozen=True)
class Query:
    """One request as the cache sees it. ``identity`` names what the served version was
    built from (its file's digest, say): a reload or a new version changes it, so old
    answers are never found again, on every replica at once."""

    model: str
    version: str
    identity: str
    tensors: bytes
    """``encode_tensors`` of the inputs."""
    parameters: str
    """The parameters that change the answer, as canonical JSON."""
    outputs: tuple[str, ...]
    """The outputs asked for, sorted (none: every output)."""

    @classmethod
    def of(
        cls,
        model: str,
        version: str,
        identity: str,
        inputs: Mapping[str, np.ndarray],
        parameters: Mapping[str, Any] | None = None,
        outputs: tuple[str, ...] | list[str] = (),
    ) -> Query:
        params = json.dumps(dict(parameters or {}), sort_keys=True, separators=(",", ":"))
        return cls(model, version, identity, encode_tensors(inputs), params, tuple(sorted(outputs)))

    def encode(self) -> bytes:
        """Every field, each length-prefixed: equal encodings mean equal queries."""
        head = (self.model, self.version, self.identity, self.parameters, *self.outputs)
        return b"".join(
            [_field(str(len(self.outputs)).encode()), *(_field(x.encode()) for x in head)]
            + [_field(self.tensors)]
        )

    def key(self) -> str:
        """Where the answer is kept: the model, its version and a digest of ``encode``."""
        digest = hashlib.blake2b(self.encode(), digest_size=16).hexdigest()
        return f"{self.model}/{self.version}/{digest}"
