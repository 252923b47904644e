"""The concat/split contract, checked in one place."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import RunnerError

__all__ = ["concat", "split"]


def concat(
    inputs: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]
) -> dict[str, np.ndarray]:
    """Stack requests along the batch dim; a single request passes through uncopied."""
    if len(inputs) == 1:
        return dict(inputs[0])
    return {name: np.concatenate([x[name] for x in inputs]) for name in names}


def split(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Cut batch outputs back into one dict per request (views, no copies).

    Raises:
        RunnerError: an output's leading dim is not the batch's total rows.
    """
    total = sum(rows)
    for name, array in outputs.items():
        got = array.shape[0] if getattr(array, "ndim", 0) else None
        if got != total:
            raise RunnerError(
                f"output {name!r} has {got} rows but the batch had {total} rows "
                f"from {len(rows)} requests"
            )
    if len(rows) == 1:
        return [dict(outputs)]
    bounds = list(itertools.accumulate(rows, initial=0))
    pairs = list(zip(bounds, bounds[1:], strict=False))
    if len(outputs) == 1:
        ((name, array),) = outputs.items()
        return [{name: array[a:b]} for a, b in pairs]
    return [{name: array[a:b] for name, array in outputs.items()} for a, b in pairs]
