"""``servekit accuracy``: how far a lower-precision model drifts from its FP32 reference.

Both models classify the same fixed image set through the same Preprocess; the report
gives top-1 agreement, top-5 overlap, and the maximum and mean relative logit error
(per image, the largest absolute logit difference over the reference's largest absolute
logit). The default image set is scikit-image's sample photos (a cat, coffee, an
astronaut, a rocket, ...) in several crops and flips, so a trained classifier sees
real pictures.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .runners.base import Runner

__all__ = ["AccuracyReport", "compare_models", "photo_set"]

_PHOTOS = (
    "chelsea",
    "coffee",
    "astronaut",
    "rocket",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "colorwheel",
    "cat",
    "motorcycle_left",
)


@dataclass(frozen=True)
class AccuracyReport:
    """Agreement of ``candidate`` with ``reference`` over ``images`` images."""

    reference: str
    candidate: str
    images: int
    top1_agreement: float
    top5_overlap: float
    max_rel_logit_error: float
    mean_rel_logit_error: float
    confident_images: int
    """Images where the reference's top-1 probability beats its second by ``margin``."""
    top1_agreement_confident: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def photo_set(variants: bool = True) -> list[bytes]:
    """scikit-image's colour sample photos as JPEGs, each also flipped and cropped."""
    from PIL import Image

    from .samples import skimage_photo, to_jpeg

    out: list[bytes] = []
    for name in _PHOTOS:
        img = skimage_photo(name)
        if img is None:
            continue
        views = [img]
        if variants:
            w, h = img.size
            cw, ch = int(w * 0.8), int(h * 0.8)
            views += [
                img.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                img.crop((0, 0, cw, ch)),
                img.crop((w - cw, h - ch, w, h)),
                img.crop(((w - cw) // 2, (h - ch) // 2, (w + cw) // 2, (h + ch) // 2)),
            ]
        out += [to_jpeg(view) for view in views]
    return out


def _logits(runner: Runner, tensors: list[np.ndarray]) -> np.ndarray:
    name = runner.spec.inputs[0].name
    out = runner.spec.outputs[0].name
    return np.concatenate([runner.infer({name: t})[out] for t in tensors]).astype(np.float64)


def compare_models(
    reference: str | os.PathLike[str],
    candidate: str | os.PathLike[str],
    images: Sequence[bytes] | None = None,
    *,
    batch_size: int = 8,
    margin: float = 0.1,
) -> AccuracyReport:
    """Classify ``images`` (default ``photo_set()``) with both ONNX models and compare.

    Top-1 agreement is reported over all images and over those the reference is
    confident about (top-1 probability ahead of the second by ``margin``): on an image
    the reference itself finds ambiguous, a flip between two near-equal classes says
    little about the candidate.
    """
    from .pipeline import image_classifier
    from .runners.onnx import OnnxRuntimeRunner

    images = list(images) if images is not None else photo_set()
    if not images:
        raise ValueError("accuracy: no images to compare on")
    ref = OnnxRuntimeRunner(reference)
    cand = OnnxRuntimeRunner(candidate)
    try:
        pre = image_classifier(ref).steps[0]  # the reference's scaling, for both models
        tensors = [
            pre.images(list(images[i : i + batch_size]))  # type: ignore[attr-defined]
            for i in range(0, len(images), batch_size)
        ]
        a, b = _logits(ref, tensors), _logits(cand, tensors)
    finally:
        ref.close()
        cand.close()
    top_a, top_b = np.argsort(-a, axis=1)[:, :5], np.argsort(-b, axis=1)[:, :5]
    overlap = [len(set(x) & set(y)) / 5 for x, y in zip(top_a, top_b, strict=True)]
    rel = np.abs(a - b).max(axis=1) / np.maximum(np.abs(a).max(axis=1), 1e-12)
    agree = top_a[:, 0] == top_b[:, 0]
    probs = np.exp(a - a.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    ranked = np.sort(probs, axis=1)
    confident = ranked[:, -1] - ranked[:, -2] >= margin
    return AccuracyReport(
        reference=Path(reference).name,
        candidate=Path(candidate).name,
        images=len(images),
        top1_agreement=float(agree.mean()),
        top5_overlap=float(np.mean(overlap)),
        max_rel_logit_error=float(rel.max()),
        mean_rel_logit_error=float(rel.mean()),
        confident_images=int(confident.sum()),
        top1_agreement_confident=float(agree[confident].mean()) if confident.any() else 1.0,
    )
