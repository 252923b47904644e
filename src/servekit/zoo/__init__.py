"""Reference models built locally from their architecture and a fixed seed, never downloaded.

Built models are cached as ``<cache_dir>/<name>.onnx``; the cache directory is
``$SERVEKIT_CACHE`` or ``~/.cache/servekit/models``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..errors import ModelNotFound
from ..storage import StorageConfig, fetch, is_remote
from ._onnx import param_count
from .efficientnet import build_efficientnet_lite0
from .resnet import RESNET50_PARAMS_WITH_BN, build_resnet50
from .tiny import build_accumulate, build_add_sub, build_sim_t4, build_tiny_cnn

__all__ = [
    "MODELS",
    "RESNET50_PARAMS_WITH_BN",
    "ZooModel",
    "build",
    "cache_dir",
    "param_count",
    "resolve",
]


@dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    builder: Callable[[], onnx.ModelProto]


MODELS: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            "resnet50",
            "ResNet-50 v1.5, NCHW float32 224x224 -> 1000 logits, BN folded, seed 0",
            build_resnet50,
        ),
        ZooModel(
            "efficientnet_lite0",
            "EfficientNet-Lite0, ImageNet-trained (servekit[trained]), 224x224 -> 1000 logits",
            build_efficientnet_lite0,
        ),
        ZooModel("tiny_cnn", "conv+pool+dense, float32 [N,3,32,32] -> 10 logits", build_tiny_cnn),
        ZooModel("add_sub", "INPUT0+INPUT1, INPUT0-INPUT1 over float32 [N,16]", build_add_sub),
        ZooModel(
            "accumulate",
            "OUTPUT = INPUT + STATE_IN (STATE_OUT the same) over float32 [N,4]: the running sum "
            "of a sequence, with implicit state",
            build_accumulate,
        ),
        ZooModel(
            "sim_t4",
            "simulated T4 (ResNet-50 INT8, 8x slower): 8 ms + 1.6 ms/row, no CPU, [N,64,64,3]",
            build_sim_t4,
        ),
    )
}


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where built models live: ``override``, else ``$SERVEKIT_CACHE``, else ``~/.cache/servekit/models``."""
    if override is not None:
        return Path(override)
    env = os.environ.get("SERVEKIT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "servekit" / "models"


def build(
    name: str, directory: str | os.PathLike[str] | None = None, *, force: bool = False
) -> Path:
    """Build zoo model ``name`` into the cache (unless present) and return its ``.onnx`` path.

    Raises:
        ModelNotFound: ``name`` is not in the zoo.
    """
    if name not in MODELS:
        raise ModelNotFound(f"no zoo model {name!r}; available: {sorted(MODELS)}")
    path = cache_dir(directory) / f"{name}.onnx"
    if path.exists() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = MODELS[name].builder().SerializeToString()
    # Write then rename so a concurrent reader never sees half a model.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".onnx.tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path


def resolve(
    model: str | os.PathLike[str],
    directory: str | os.PathLike[str] | None = None,
    storage: StorageConfig | None = None,
) -> Path:
    """A zoo model's built file (building it on first use), an ``s3://``/``gs://`` object's
    file in the node-local cache (``servekit.storage.fetch``), or an existing model file.

    Raises:
        ModelNotFound: ``model`` is neither a zoo name, an object nor an existing file.
        FetchFailed: the object could not be fetched, naming it and why.
    """
    if str(model) in MODELS:
        return build(str(model), directory)
    if is_remote(model):
        return fetch(str(model), storage)
    path = Path(model)
    if not path.is_file():
        raise ModelNotFound(f"no zoo model or model file {str(model)!r}; zoo: {sorted(MODELS)}")
    return path
