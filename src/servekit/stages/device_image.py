"""Images decoded where the model runs: a batch of encoded images -> the model's normalised
[N,3,S,S] input as a torch tensor on its device, with no host copy of the pixels.

JPEGs decode in one batched call of torchvision's ``decode_jpeg`` on the device (nvJPEG,
and the hardware JPEG decoder where the GPU has one); each is then resized (bilinear,
antialiased as Pillow's is), centre-cropped and scaled there. PNG and any other format,
a CMYK JPEG, or a JPEG the device decoder refuses, take ``decode_image`` (Pillow, on the
host) for that image alone and are uploaded as pixels. Sizes and crops are
``Preprocess``'s, so the two paths differ only by the decoders' and resamplers' rounding
(with torchvision on the CPU, on the sample photos: at most 2 of 255 per channel, and all
but a few pixels in a million within 1).

On a GPU the batch is decoded on the calling thread's own stream, never the legacy default
one, and ``batch`` hands it over as a ``DeviceTensor`` whose ``ready`` event the model's
lane waits on (``servekit.cuda``).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from typing import Any

import numpy as np
from PIL import Image

from ..cuda import for_device
from ..device import DeviceTensor
from .image import Preprocess, decode_image, fit, pixel_scaling

__all__ = ["DeviceDecode", "device_decode_available"]


def device_decode_available() -> bool:
    """Whether torchvision (with its image decoders) is installed."""
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return False
    return True


class DeviceDecode:
    """``Preprocess``'s work on a torch ``device``: ``__call__`` takes the BYTES column and
    returns ``float32`` [N,3,crop,crop] there. ``last_fallbacks``: how many images of the
    last batch took the host path."""

    def __init__(self, pre: Preprocess, device: Any) -> None:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as tvf

        # torchvision 0.29 deprecates its decoders for TorchCodec's, which are not yet
        # batched on CUDA; they work as before, and the warning would come per batch.
        warnings.filterwarnings(
            "ignore", "The image decoding and encoding capabilities of TorchVision",
            DeprecationWarning,
        )  # fmt: skip
        self.pre, self._torch, self._tvf = pre, torch, tvf
        self._decode_jpeg, self._rgb = decode_jpeg, ImageReadMode.RGB
        self.device = torch.device(device)
        self._gpu = for_device(self.device)
        scale, shift = pixel_scaling(pre.mean, pre.std)
        with self._on_stream() as stream:
            self._scale = torch.tensor(scale, device=self.device).reshape(1, 3, 1, 1)
            self._shift = torch.tensor(shift, device=self.device).reshape(1, 3, 1, 1)
        if self._gpu is not None:
            self._gpu.synchronize(stream)  # every thread's stream reads them from now on
        self.last_fallbacks = 0

    @contextlib.contextmanager
    def _on_stream(self) -> Any:
        """The block's device work on this thread's own stream (none on the host)."""
        if self._gpu is None:
            yield None
            return
        stream = self._gpu.side_stream(self.device)
        with self._gpu.using(stream):
            yield stream

    def _header(self, row: int, data: bytes) -> bool:
        """Whether the device decodes this image: a JPEG in RGB or greyscale that ``fit``
        takes (its header only is read). Anything else takes the host path, which names
        what is wrong with a bad image."""
        try:
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            ok = img.format == "JPEG" and img.mode in ("RGB", "L")
        except Exception:
            return False
        pre = self.pre
        fit(w, h, pre.resize, pre.crop, pre.max_pixels, f"input {pre.input_name!r} row {row}")
        return ok

    def _decoded(self, rows: list[tuple[int, bytes]]) -> dict[int, Any]:
        """Row -> [3,H,W] uint8 on the device, for every row the device decoder took."""
        torch = self._torch
        if not rows:
            return {}
        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for _, data in rows]
        try:
            images = self._decode_jpeg(encoded, mode=self._rgb, device=self.device)
            return {row: img for (row, _), img in zip(rows, images, strict=True)}
        except RuntimeError:  # one image the decoder refuses fails the batch: one by one
            out = {}
            for (row, _), data in zip(rows, encoded, strict=True):
                with contextlib.suppress(RuntimeError):  # the host path takes it
                    out[row] = self._decode_jpeg(data, mode=self._rgb, device=self.device)
            return out

    def _fit(self, img: Any, row: int) -> Any:
        """Resize the shorter side to ``resize`` and centre-crop ``crop`` (``fit``'s sizes
        and offsets, as ``decode_image``'s)."""
        pre, tvf = self.pre, self._tvf
        _, h, w = img.shape
        where = f"input {pre.input_name!r} row {row}"
        width, height, left, top = fit(w, h, pre.resize, pre.crop, pre.max_pixels, where)
        if (width, height) != (w, h):
            img = tvf.resize(
                img, [height, width], interpolation=tvf.InterpolationMode.BILINEAR,
                antialias=True,
            )  # fmt: skip
        return img[:, top : top + pre.crop, left : left + pre.crop]

    def batch(self, blobs: np.ndarray) -> DeviceTensor:
        """The decoded batch, ready on the device once its ``ready`` event has passed."""
        with self._on_stream() as stream:
            x = self._decode(blobs)
        ready = self._gpu.ready(stream) if self._gpu is not None else None
        return DeviceTensor(x, np.dtype(np.float32), ready=ready)

    def __call__(self, blobs: np.ndarray) -> Any:
        """The decoded batch as a torch tensor, finished."""
        x = self.batch(blobs)
        if x.ready is not None:
            x.ready.synchronize()
        return x.tensor

    def _decode(self, blobs: np.ndarray) -> Any:
        torch, pre = self._torch, self.pre
        column = [b.tobytes() if isinstance(b, np.ndarray) else b for b in blobs.reshape(-1)]
        on_device = []
        for row, data in enumerate(column):
            if isinstance(data, bytes | bytearray) and data and self._header(row, bytes(data)):
                on_device.append((row, bytes(data)))
        decoded = self._decoded(on_device)
        crops = []
        fallbacks = 0
        for row, data in enumerate(column):
            img = decoded.get(row)
            crop = self._fit(img, row) if img is not None else None
            if crop is None:  # the host path, which also names a bad image's fault
                fallbacks += 1
                pixels = decode_image(
                    data, pre.resize, pre.crop, pre.max_pixels, row, pre.input_name
                )
                crop = torch.from_numpy(np.array(pixels)).permute(2, 0, 1).to(self.device)
            crops.append(crop)
        self.last_fallbacks = fallbacks
        batch = torch.stack(crops).to(torch.float32)
        return batch.mul_(self._scale).add_(self._shift)
