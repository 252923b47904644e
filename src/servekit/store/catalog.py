"""Every model a store knows: the config's own models, and each one found under ``root``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ModelConfig, ServeConfig

__all__ = ["catalog"]


def _found(root: Path) -> dict[str, Path]:
    """``<name>.onnx``, ``<name>/model.onnx`` or ``<name>/<version>/model.onnx`` (highest)."""
    found: dict[str, Path] = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".onnx":
            name, path = entry.stem, entry
        elif entry.is_dir() and (entry / "model.onnx").is_file():
            name, path = entry.name, entry / "model.onnx"
        elif entry.is_dir():
            versions = [
                v for v in entry.iterdir() if v.name.isdigit() and (v / "model.onnx").is_file()
            ]
            if not versions:
                continue
            name, path = entry.name, max(versions, key=lambda v: int(v.name)) / "model.onnx"
        else:
            continue
        if name in found:
            raise ValueError(f"[store] {root}: two models named {name!r} ({found[name]}, {path})")
        found[name] = path
    return found


def catalog(config: ServeConfig) -> dict[str, ModelConfig]:
    """Name -> model: the config's ``[[models]]`` (their settings win), then every model
    under ``[store] root`` as a tensor model with the default settings."""
    models = {m.name: m for m in config.models}
    root = config.store.root
    if root is not None:
        folder = Path(root)
        if not folder.is_dir():
            raise ValueError(f"[store] root {root!r} is not a folder")
        template = ModelConfig(image=False)
        for name, path in _found(folder).items():
            if name not in models:
                try:
                    models[name] = dataclasses.replace(template, source=str(path), name=name)
                except ValueError as exc:
                    raise ValueError(f"[store] {path}: {exc}") from None
    unknown = sorted(set(config.store.pin) - set(models))
    if unknown:
        raise ValueError(f"[store] pin names unknown model(s) {unknown}")
    return models
