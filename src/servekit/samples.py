"""A few real photos by name (from scikit-image), so a first request needs no file of yours."""

from __future__ import annotations

import io
from typing import Any

__all__ = ["SAMPLES", "sample", "skimage_photo", "to_jpeg"]

SAMPLES = {
    "cat": "chelsea",
    "coffee": "coffee",
    "astronaut": "astronaut",
    "rocket": "rocket",
}
"""Sample name -> scikit-image's photo: a tabby cat, a cup of espresso, an astronaut, a rocket."""


def skimage_photo(name: str) -> Any:
    """scikit-image's colour photo ``name`` as an RGB ``PIL.Image``, or None when it has no
    such colour photo here (one it would have to download, or a grey one)."""
    from PIL import Image

    try:
        import skimage.data
    except ImportError:
        raise ImportError(
            "the sample photos need scikit-image: pip install 'servekit[trained]'"
        ) from None
    loader = getattr(skimage.data, name, None)
    if loader is None:
        return None
    try:
        array = loader()
    except Exception:  # a photo scikit-image would have to download
        return None
    if array.ndim == 2 or array.shape[-1] not in (3, 4):
        return None
    return Image.fromarray(array[..., :3])


def to_jpeg(image: Any, quality: int = 92) -> bytes:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def sample(name: str) -> bytes:
    """The sample photo ``name`` (see ``SAMPLES``) as JPEG bytes.

    Raises:
        ValueError: an unknown name, naming the known ones.
    """
    if name not in SAMPLES:
        raise ValueError(f"no sample photo {name!r}; choose from {sorted(SAMPLES)}")
    image = skimage_photo(SAMPLES[name])
    if image is None:
        raise ValueError(f"scikit-image has no photo {SAMPLES[name]!r} here")
    return to_jpeg(image)
