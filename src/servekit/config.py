"""Serving configuration files (TOML, or YAML when PyYAML is installed): the CLI's knobs.

::

    model = "resnet50"            # zoo name or path to an .onnx file
    instances = 1                 # model instances (Triton instance_group count)
    threads = 2                   # ONNX Runtime intra-op threads
    top_k = 5

    [server]
    http_port = 8000
    grpc_port = 8001
    metrics_port = 8002

    [batching]                    # BatchingPolicy
    max_batch_size = 32
    preferred_batch_sizes = [8, 16]
    max_queue_delay_us = 1000

    [batching.queue]              # QueuePolicy (the default one)
    max_queue_size = 256
    default_timeout_us = 0
    timeout_action = "REJECT"
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .batching.policy import BatchingPolicy, QueuePolicy

__all__ = ["load_config", "policy_from_dict"]

TOP_LEVEL = {
    "model",
    "name",
    "instances",
    "threads",
    "top_k",
    "labels",
    "cache_dir",
    "runtime",
    "server",
    "batching",
}
SERVER = {"host", "http_port", "grpc_port", "metrics_port", "log_verbose", "exit_timeout_s"}


def _check_keys(section: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(
            f"unknown key(s) {unknown} in [{section}]; expected some of {sorted(allowed)}"
        )


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a config file; returns plain dicts (sections ``server``, ``batching``)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"{path}: YAML needs PyYAML (pip install pyyaml), or use TOML"
            ) from None
        data = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            import tomli as tomllib  # type: ignore[no-redef]
        data = tomllib.loads(text)
    else:
        raise ValueError(f"{path}: config files must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a table of settings, got {type(data).__name__}")
    _check_keys("top level", data, TOP_LEVEL)
    _check_keys("server", data.get("server", {}), SERVER)
    policy_from_dict(data.get("batching", {}))  # fail early, with the field named
    return data


def policy_from_dict(data: Mapping[str, Any]) -> BatchingPolicy:
    """A ``BatchingPolicy`` from a ``[batching]`` table (``queue`` = its default QueuePolicy)."""
    fields = {f.name for f in dataclasses.fields(BatchingPolicy)} - {
        "default_queue_policy",
        "priority_queue_policies",
    }
    _check_keys("batching", data, fields | {"queue"})
    queue = dict(data.get("queue", {}))
    _check_keys("batching.queue", queue, {f.name for f in dataclasses.fields(QueuePolicy)})
    kwargs = {k: v for k, v in data.items() if k != "queue"}
    if "preferred_batch_sizes" in kwargs:
        kwargs["preferred_batch_sizes"] = tuple(kwargs["preferred_batch_sizes"])
    return BatchingPolicy(**kwargs, default_queue_policy=QueuePolicy(**queue))
