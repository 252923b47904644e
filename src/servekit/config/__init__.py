"""``ServeConfig``: what to serve and how, one description consumed by every runtime.

Built from a TOML or YAML file and/or command-line flags; every default lives here once.
Each runtime (``native``, ``pytriton``, ``triton``, ``ray``) takes a ``ServeConfig`` and
nothing else, and a knob a runtime cannot honour is an error naming the knob and the
runtime (``ServeConfig.check``), never silently dropped.

::

    runtime = "pytriton"            # native | pytriton | triton | ray

    [server]
    http_port = 8000                # also grpc_port, metrics_port, host, front, tokens
    front = true

    [[models]]
    source = "resnet50"             # zoo name or path to an .onnx file
    name = "resnet50"               # default: the zoo name or the file's stem
    engine = "onnxruntime"          # onnxruntime | tensorrt | torch
    instances = 2                   # Triton instance_group count / Ray replicas / Batcher threads
    threads = 1                     # ONNX Runtime intra-op threads per instance
    top_k = 5                       # the <name>_image model's answers
    [models.batching]               # BatchingPolicy (Triton's dynamic_batching)
    max_batch_size = 16
    preferred_batch_sizes = [4, 8]
    max_queue_delay_us = 500
    [models.batching.queue]         # its default QueuePolicy
    max_queue_size = 64

A file with one model may put the model's keys at the top level and ``[batching]`` beside
them (``model = "resnet50"`` is ``source``), as earlier servekit versions wrote it.
"""

from __future__ import annotations

from ..runners import ENGINES
from .model import ModelConfig
from .names import (
    MAX_BODY_BYTES,
    PRECISIONS,
    RUNTIMES,
    image_model_name,
    model_name,
    split_version_name,
    version_model_name,
)  # fmt: skip
from .serve import ServeConfig, load_config
from .server import CacheConfig, RayOptions, ServerConfig, StoreConfig, TracingConfig

__all__ = [
    "ENGINES",
    "MAX_BODY_BYTES",
    "PRECISIONS",
    "RUNTIMES",
    "ModelConfig",
    "CacheConfig",
    "RayOptions",
    "ServeConfig",
    "ServerConfig",
    "StoreConfig",
    "TracingConfig",
    "image_model_name",
    "load_config",
    "model_name",
    "split_version_name",
    "version_model_name",
]
