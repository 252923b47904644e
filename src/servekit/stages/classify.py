"""Classification postprocessing: logits -> softmax -> top-k scores, class ids and labels."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from ..runners.base import Arrays, BaseRunner
from ..spec import ModelSpec, TensorSpec

__all__ = ["Postprocess", "load_labels", "softmax", "top_k"]


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, stable for large logits."""
    z = logits - logits.max(axis=-1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest scores per row, best first; ties go to the lower index."""
    k = min(k, scores.shape[-1])
    part = np.argpartition(-scores, k - 1, axis=-1)[:, :k]
    # argpartition picks arbitrarily among values tied with the k-th; such rows get a full
    # stable sort so the result never depends on the partition's internals.
    kth = np.take_along_axis(scores, part, axis=-1).min(axis=-1, keepdims=True)
    tied = (scores >= kth).sum(axis=-1) != k
    if tied.any():
        part[tied] = np.argsort(-scores[tied], axis=-1, kind="stable")[:, :k]
    order = np.lexsort((part, -np.take_along_axis(scores, part, axis=-1)), axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def load_labels(
    source: str | os.PathLike[str] | Sequence[str] | None, num_classes: int
) -> list[str]:
    """Labels from a list or a text file (one per line); ``class_<i>`` when none are given."""
    if source is None:
        return [f"class_{i}" for i in range(num_classes)]
    if isinstance(source, str | os.PathLike):
        labels = Path(source).read_text(encoding="utf-8").splitlines()
    else:
        labels = list(source)
    if len(labels) != num_classes:
        raise ValueError(f"expected {num_classes} labels, got {len(labels)}")
    return labels


class Postprocess(BaseRunner):
    """Stage ``logits`` (FP32 [N,C]) -> ``scores`` (FP32 [N,k]), ``classes`` (INT64), ``labels`` (BYTES)."""

    def __init__(
        self,
        *,
        num_classes: int = 1000,
        top_k: int = 5,
        labels: str | os.PathLike[str] | Sequence[str] | None = None,
        max_batch_size: int = 64,
        input_name: str = "logits",
    ) -> None:
        if not 1 <= top_k <= num_classes:
            raise ValueError(f"top_k must be in [1, {num_classes}], got {top_k}")
        self.k, self.input_name = top_k, input_name
        self.labels = load_labels(labels, num_classes)
        self._label_bytes = np.array([s.encode() for s in self.labels], dtype=object)
        self._spec = ModelSpec(
            (TensorSpec(input_name, np.float32, [num_classes]),),
            (
                TensorSpec("scores", np.float32, [top_k]),
                TensorSpec("classes", np.int64, [top_k]),
                TensorSpec("labels", "BYTES", [top_k]),
            ),
            max_batch_size,
        )

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        probs = softmax(inputs[self.input_name].astype(np.float32, copy=True))
        idx = top_k(probs, self.k)
        return {
            "scores": np.take_along_axis(probs, idx, axis=-1),
            "classes": idx.astype(np.int64),
            "labels": self._label_bytes[idx],
        }
