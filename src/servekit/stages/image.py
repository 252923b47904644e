"""Image preprocessing: encoded JPEG/PNG bytes -> normalised CHW float32, the torchvision recipe.

decode -> RGB -> resize shorter side to 256 (bilinear) -> centre-crop 224 ->
``(x / 255 - mean) / std`` with ImageNet's mean and std -> CHW float32.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..errors import InvalidInput
from ..runners.base import Arrays, BaseRunner
from ..spec import ModelSpec, TensorSpec

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_SUFFIXES",
    "Preprocess",
    "decode_image",
    "fit",
    "input_scaling",
    "pixel_scaling",
    "synthetic_image",
]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
"""File suffixes servekit treats as images when it walks a folder (batch jobs, calibration)."""
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def pixel_scaling(mean: Sequence[float], std: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """``(x / 255 - mean) / std`` as ``x * scale + shift``: the per-channel FP32 ``scale``
    and ``shift`` every path that scales pixels uses (Preprocess, DeviceDecode, a model
    with its scaling folded in), so all of them compute the same floats."""
    std_arr = np.asarray(std, dtype=np.float64)
    scale = (1.0 / (255.0 * std_arr)).astype(np.float32)
    shift = (-np.asarray(mean, dtype=np.float64) / std_arr).astype(np.float32)
    return scale, shift


def input_scaling(
    metadata: Mapping[str, str] | None,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and std a classifier's pixels are scaled by: its metadata's
    ``servekit.mean`` and ``servekit.std`` (the zoo writes them), else ImageNet's."""
    import json

    meta = metadata or {}
    mean = tuple(json.loads(meta["servekit.mean"])) if "servekit.mean" in meta else IMAGENET_MEAN
    std = tuple(json.loads(meta["servekit.std"])) if "servekit.std" in meta else IMAGENET_STD
    return mean, std


def fit(
    w: int, h: int, resize: int, crop: int, max_pixels: int, where: str
) -> tuple[int, int, int, int]:
    """A ``w``x``h`` image's size once its shorter side is ``resize``, and where the centred
    ``crop`` starts in it: (width, height, left, top). ``InvalidInput`` naming ``where``
    if the image, as decoded or as resized, holds more than ``max_pixels`` (a 200-byte
    PNG of 30000x2 would resize to 3,840,000x256: gigabytes, from one request), or if the
    resized image is smaller than the crop."""
    if w * h > max_pixels:
        raise InvalidInput(
            f"{where}: image of {w}x{h} pixels exceeds the limit of {max_pixels} pixels"
        )
    width, height = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    if width * height > max_pixels:
        raise InvalidInput(
            f"{where}: image of {w}x{h} pixels would resize to {width}x{height}, over the "
            f"limit of {max_pixels} pixels"
        )
    if width < crop or height < crop:
        raise InvalidInput(f"{where}: resized image {width}x{height} is smaller than crop {crop}")
    return width, height, int(round((width - crop) / 2.0)), int(round((height - crop) / 2.0))


def decode_image(
    data: bytes,
    resize: int = 256,
    crop: int = 224,
    max_pixels: int = 64_000_000,
    row: int = 0,
    tensor: str = "image",
) -> np.ndarray:
    """Decode, resize the shorter side to ``resize`` and centre-crop ``crop``; HWC uint8 RGB.

    Raises:
        InvalidInput: the bytes are not a decodable image, or it is too large (``fit``).
    """
    where = f"input {tensor!r} row {row}"
    if isinstance(data, np.ndarray):  # a BYTES element read from an ``S`` array
        data = data.tobytes()
    if not isinstance(data, bytes | bytearray) or not data:
        raise InvalidInput(
            f"{where}: expected encoded image bytes, got "
            f"{'empty bytes' if isinstance(data, bytes | bytearray) else type(data).__name__}"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img: Image.Image = Image.open(io.BytesIO(data))
            w, h = img.size
            width, height, left, top = fit(w, h, resize, crop, max_pixels, where)
            img = img.convert("RGB")
    except InvalidInput:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own limit, met before ours
        said = re.search(r"\((\d+) pixels\)", str(exc))  # its size is only in the text
        image = f"image of {said[1]} pixels" if said else "image"
        raise InvalidInput(
            f"{where}: {image} exceeds the limit of {max_pixels} pixels "
            f"(Pillow refuses over {2 * (Image.MAX_IMAGE_PIXELS or 0)})"
        ) from None
    except Exception as exc:  # PIL raises several unrelated types for bad data
        reason = (
            "not an image format Pillow can read"
            if isinstance(exc, UnidentifiedImageError)
            else f"{type(exc).__name__}: {exc}"
        )
        raise InvalidInput(
            f"{where}: cannot decode image ({len(data)} bytes, "
            f"starting {bytes(data[:8])!r}): {reason}"
        ) from None
    if (width, height) != (w, h):
        img = img.resize((width, height), Image.Resampling.BILINEAR)
    img = img.crop((left, top, left + crop, top + crop))
    return np.asarray(img, dtype=np.uint8)


def synthetic_image(seed: int = 0, size: tuple[int, int] = (320, 240), fmt: str = "JPEG") -> bytes:
    """An encoded image of smooth colour gradients, for demos, warm-up and tests without files."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    phases = rng.uniform(0, 2 * np.pi, 3)
    periods = rng.uniform(15, 60, (3, 2))
    rgb = np.stack(
        [127 + 120 * np.sin(xx / periods[c, 0] + yy / periods[c, 1] + phases[c]) for c in range(3)],
        axis=-1,
    )
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, fmt)
    return buf.getvalue()


class Preprocess(BaseRunner):
    """Stage ``image`` (BYTES [N,1]) -> ``input`` (FP32 [N,3,crop,crop]).

    Images decode on up to ``workers`` threads (Pillow releases the GIL while decoding
    and resizing); normalisation runs once over the whole batch.
    """

    def __init__(
        self,
        *,
        resize: int = 256,
        crop: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        max_batch_size: int = 64,
        workers: int | None = None,
        max_pixels: int = 64_000_000,
        input_name: str = "image",
        output_name: str = "input",
    ) -> None:
        if crop > resize:
            raise ValueError(f"crop ({crop}) must not exceed resize ({resize})")
        self.resize, self.crop, self.max_pixels = resize, crop, max_pixels
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self.input_name, self.output_name = input_name, output_name
        self._scale, self._shift = pixel_scaling(mean, std)
        self._workers = workers if workers is not None else min(4, os.cpu_count() or 1)
        self._pool = (
            ThreadPoolExecutor(self._workers, "servekit-decode") if self._workers > 1 else None
        )
        self._spec = ModelSpec(
            (TensorSpec(input_name, "BYTES", [1]),),
            (TensorSpec(output_name, np.float32, [3, crop, crop]),),
            max_batch_size,
        )

    def _decode(self, args: tuple[int, object]) -> np.ndarray:
        row, data = args
        return decode_image(data, self.resize, self.crop, self.max_pixels, row, self.input_name)  # type: ignore[arg-type]

    def _run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        blobs = inputs[self.input_name].reshape(-1)
        rows = list(enumerate(blobs))
        if self._pool is not None and len(rows) > 1:
            images = list(self._pool.map(self._decode, rows))
        else:
            images = [self._decode(r) for r in rows]
        batch = np.stack(images)  # N,H,W,3 uint8
        out = np.empty((len(images), 3, self.crop, self.crop), dtype=np.float32)
        for c in range(3):
            np.multiply(batch[..., c], self._scale[c], out=out[:, c], dtype=np.float32)
            out[:, c] += self._shift[c]
        return {self.output_name: out}

    def warmup(self, batch_sizes: tuple[int, ...] = (1,)) -> None:
        for n in batch_sizes:
            self.images([synthetic_image(i) for i in range(min(n, self._spec.max_batch_size))])

    def images(self, images: Sequence[bytes]) -> np.ndarray:
        """Preprocess a list of encoded images to one FP32 batch."""
        blobs = np.empty((len(images), 1), dtype=object)
        blobs[:, 0] = list(images)
        return self.infer({self.input_name: blobs})[self.output_name]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
