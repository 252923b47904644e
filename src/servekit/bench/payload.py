"""Request payloads for a model: encoded images for BYTES inputs, random tensors otherwise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..spec import as_dtype

__all__ = ["payload_from_metadata"]


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
