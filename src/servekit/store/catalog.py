"""Every model a store knows: the config's own models, and each one found under ``root``
(a folder, or an ``s3://``/``gs://`` prefix listed without fetching a model)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..config import ModelConfig, ServeConfig
from ..storage import StorageConfig, is_remote
from ..storage.objects import listing

__all__ = ["catalog"]


def _found(files: list[str], where: str) -> dict[str, tuple[int, str]]:
    """Name -> (version, relative file), from a root's relative file paths: ``<name>.onnx``
    and ``<name>/model.onnx`` (version 1), or ``<name>/<version>/model.onnx`` (the highest
    version, Triton's default policy, which keeps its number)."""
    found: dict[str, tuple[int, str]] = {}
    for rel in files:
        parts = rel.split("/")
        if len(parts) == 1 and rel.endswith(".onnx"):
            name, version = rel[: -len(".onnx")], -1
        elif len(parts) == 2 and parts[1] == "model.onnx":
            name, version = parts[0], -1
        elif len(parts) == 3 and parts[2] == "model.onnx" and parts[1].isdigit():
            name, version = parts[0], int(parts[1])
        else:
            continue
        if name in found and (found[name][0] < 0 or version < 0):
            raise ValueError(
                f"[store] {where}: two models named {name!r} ({found[name][1]}, {rel})"
            )
        if name not in found or version > found[name][0]:
            found[name] = (version, rel)
    return {name: (max(version, 1), rel) for name, (version, rel) in found.items()}


def _files(root: str, storage: StorageConfig) -> list[str]:
    """Every file up to three levels under ``root`` (a folder, or a store's prefix)."""
    if is_remote(root):
        return listing(root, storage)
    folder = Path(root)
    if not folder.is_dir():
        raise ValueError(f"[store] root {root!r} is not a folder")
    files = []
    for path, dirs, names in os.walk(folder):
        depth = len(Path(path).relative_to(folder).parts)
        if depth >= 2:
            dirs.clear()
        files += [str((Path(path) / n).relative_to(folder)) for n in names]
    return sorted(files)


def catalog(config: ServeConfig) -> dict[str, ModelConfig]:
    """Name -> model: the config's ``[[models]]`` (their settings win), then every model
    under ``[store] root`` as a tensor model with the default settings."""
    models = {m.name: m for m in config.models}
    root = config.store.root
    if root is not None:
        template = ModelConfig(image=False)
        for name, (version, rel) in _found(_files(root, config.storage), root).items():
            if name not in models:
                source = f"{root.rstrip('/')}/{rel}" if is_remote(root) else str(Path(root, rel))
                try:
                    models[name] = dataclasses.replace(
                        template, source=source, name=name, version=version
                    )
                except ValueError as exc:
                    raise ValueError(f"[store] {source}: {exc}") from None
    unknown = sorted(set(config.store.pin) - set(models))
    if unknown:
        raise ValueError(f"[store] pin names unknown model(s) {unknown}")
    return models
