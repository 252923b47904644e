"""Request payloads for a model: encoded images for BYTES inputs, random tensors otherwise;
a whole KServe v2 HTTP request as bytes, for a client that owns its socket."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..spec import as_dtype

__all__ = ["payload_from_metadata", "raw_http_infer"]


def raw_http_infer(
    model: str, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any] | None = None
) -> bytes:
    """``POST /v2/models/<model>/infer`` with ``inputs`` as binary tensors (FP32 and the
    like: numpy's dtypes by Triton's names), the request's ``parameters`` in its JSON
    header: the bytes a client that must close or reset its own socket sends."""
    tensors = [
        {"name": name, "shape": list(a.shape), "datatype": as_dtype(a.dtype).datatype,
         "parameters": {"binary_data_size": a.nbytes}}
        for name, a in inputs.items()
    ]  # fmt: skip
    head = json.dumps({"inputs": tensors, "parameters": dict(parameters or {})}).encode()
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs.values())
    return (
        (
            f"POST /v2/models/{model}/infer HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"inference-header-content-length: {len(head)}\r\n"
            f"content-length: {len(head) + len(data)}\r\n\r\n"
        ).encode()
        + head
        + data
    )


def payload_from_metadata(
    inputs: Sequence[Mapping[str, Any]],
    batch_size: int = 1,
    seed: int = 0,
    images: Sequence[bytes] = (),
) -> dict[str, np.ndarray]:
    """One request for a model described by KServe v2 metadata ``inputs`` (name, datatype, shape).

    The leading ``-1`` is the batch (``batch_size``); other variable dims become 1;
    BYTES inputs get ``images`` (cycled) or generated 320x240 JPEGs, so image models
    decode real images.
    """
    from ..stages import synthetic_image

    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in inputs:
        shape = [int(d) for d in spec["shape"]]
        if shape and shape[0] == -1:
            shape[0] = batch_size
        shape = [1 if d == -1 else d for d in shape]
        dtype = as_dtype(spec["datatype"])
        if dtype.datatype == "BYTES":
            count = int(np.prod(shape))
            arr = np.empty(count, dtype=object)
            if images:
                arr[:] = [images[i % len(images)] for i in range(count)]
            else:
                arr[:] = [synthetic_image(seed + i) for i in range(count)]
            out[spec["name"]] = arr.reshape(shape)
        elif dtype.numpy.kind == "f":
            out[spec["name"]] = rng.standard_normal(shape).astype(dtype.numpy)
        else:
            out[spec["name"]] = rng.integers(0, 100, shape).astype(dtype.numpy)
    return out
