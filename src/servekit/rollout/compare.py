"""Whether two versions answered alike: the same outputs, shapes and dtypes; floating-point
values within a tolerance for their precision, everything else exactly."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["TOLERANCE", "same_answer"]

TOLERANCE: dict[str, tuple[float, float]] = {
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
    "float32": (1e-4, 1e-5),
    "float64": (1e-7, 1e-9),
}
"""dtype -> (rtol, atol) for ``numpy.allclose``."""


def same_answer(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype.kind == "f":
            rtol, atol = TOLERANCE.get(x.dtype.name, (1e-4, 1e-5))
            if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif not np.array_equal(x, y):
            return False
    return True
