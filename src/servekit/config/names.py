"""What servekit calls things: runtimes, precisions, and each served name (a model's, its
image model's, a version's own)."""

from __future__ import annotations

import os
import re

from ..custom import is_import_path
from ..storage import is_remote

__all__ = [
    "MAX_BODY_BYTES", "NAME", "PRECISIONS", "RUNTIMES", "image_model_name", "model_name",
    "split_version_name", "version_model_name",
]  # fmt: skip

RUNTIMES = ("pytriton", "triton", "native", "ray")
"""``pytriton``: PyTriton (Triton's C++ batcher, servekit's runners in Python backend stubs);
``triton``: tritonserver with servekit's Triton backend on a repository rendered from the
config; ``native``: servekit's own KServe v2 server in one process; ``ray``: Ray Serve."""
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
MAX_BODY_BYTES = 64 * 1024 * 1024
"""The default request size limit (``ServerConfig.max_body_bytes``), for every server."""
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def model_name(source: str | os.PathLike[str]) -> str:
    """The served name of a zoo model or an ONNX file (its stem); for an object in a store
    laid out as a repository (``.../<name>/model.onnx``, ``.../<name>/<version>/model.onnx``)
    the name's folder."""
    text = os.fspath(source)
    if is_import_path(text):  # your own model: the attribute it names
        return text.rpartition(":")[2].rpartition(".")[2]
    parts = [p for p in text.split("/") if p]
    if is_remote(text) and parts[-1] == "model.onnx" and len(parts) > 3:
        folder = parts[-2] if not parts[-2].isdigit() or len(parts) < 5 else parts[-3]
        return folder
    return os.path.splitext(os.path.basename(text))[0]


def image_model_name(name: str) -> str:
    """The name of the image model (encoded images in, top-k out) served beside ``name``."""
    return f"{name}_image"


def version_model_name(name: str, version: int) -> str:
    """The one spelling of a version's own served name, on every runtime: the Triton model
    that serves version ``version`` (> 1) of ``name`` on PyTriton (which binds one version
    per Triton model), a Batcher's name on native, a chain's key in Ray's ingress; the
    front routes ``name`` to it."""
    return f"{name}.v{version}"


def split_version_name(served: str) -> tuple[str, int]:
    """``version_model_name``'s way back: ``(name, version)``; a plain name is version 1."""
    name, dot, number = served.rpartition(".v")
    if dot and number.isdigit() and int(number) > 1:
        return name, int(number)
    return served, 1
