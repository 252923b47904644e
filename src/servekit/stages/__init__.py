"""Pre- and post-processing stages (image decoding/normalisation, classification top-k)."""

from .base import Stage
from .classify import Postprocess, load_labels, softmax, top_k
from .device_image import DeviceDecode
from .image import (
    IMAGE_SUFFIXES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    Preprocess,
    decode_image,
    input_scaling,
    pixel_scaling,
    synthetic_image,
)

__all__ = [
    "DeviceDecode",
    "IMAGE_SUFFIXES",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Postprocess",
    "Preprocess",
    "Stage",
    "decode_image",
    "input_scaling",
    "pixel_scaling",
    "synthetic_image",
    "load_labels",
    "softmax",
    "top_k",
]
