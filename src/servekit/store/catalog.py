"""Every model a store knows: the config's own models, and each one found under ``root``
(a folder, or an ``s3://``/``gs://`` prefix listed without fetching a model)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..config import ModelConfig, ServeConfig
from ..rollout.policy import ModelVersion
from ..storage import StorageConfig, is_remote
from ..storage.objects import listing

__all__ = ["catalog"]


def _found(files: list[str], where: str) -> dict[str, dict[int, str]]:
    """Name -> {version: relative file}, from a root's relative file paths: ``<name>.onnx``
    and ``<name>/model.onnx`` (version 1), or Triton's ``<name>/<version>/model.onnx``."""
    found: dict[str, dict[int, str]] = {}
    flat: set[str] = set()
    for rel in files:
        parts = rel.split("/")
        if len(parts) == 1 and rel.endswith(".onnx"):
            name, version = rel[: -len(".onnx")], 0
        elif len(parts) == 2 and parts[1] == "model.onnx":
            name, version = parts[0], 0
        elif len(parts) == 3 and parts[2] == "model.onnx" and parts[1].isdigit():
            name, version = parts[0], int(parts[1])
        else:
            continue
        if name in found and (name in flat or version == 0):
            other = next(iter(found[name].values()))
            raise ValueError(f"[store] {where}: two models named {name!r} ({other}, {rel})")
        if version == 0:
            flat.add(name)
        found.setdefault(name, {})[max(version, 1)] = rel
    return found


def _served(model: ModelConfig, held: dict[int, str], where: str) -> list[int]:
    """The versions of a stored model that are served: its ``version_policy`` (Triton's;
    the highest by default) and every version its traffic names, each one a folder."""
    policy = model.version_policy
    if isinstance(policy, tuple):
        chosen = set(policy)
    else:
        chosen = set(held) if policy == "all" else {max(held)}
    chosen |= set(model.named_versions)
    missing = sorted(chosen - set(held))
    if missing:
        raise ValueError(
            f"[store] {where}: model {model.name!r} has no version folder {missing} "
            f"(named by its version_policy or [models.traffic]); it holds {sorted(held)}"
        )
    return sorted(chosen)


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
    """Name -> model: the config's ``[[models]]`` (their settings win; one without a
    source is the stored model of its name), then every model under ``[store] root`` as a
    tensor model with the default settings. A stored model is served at its highest
    version, or at the versions its ``version_policy`` and traffic name (the highest is
    its own, the others beside it)."""
    models = {m.name: m for m in config.models}
    root = config.store.root or ""
    found = _found(_files(root, config.storage), root) if root else {}
    template = ModelConfig(image=False)
    for name, held in found.items():
        model = models.get(name, template)
        if name in models and model.source:
            continue
        numbers = _served(model, held, root)
        sources = {
            v: f"{root.rstrip('/')}/{held[v]}" if is_remote(root) else str(Path(root, held[v]))
            for v in numbers
        }
        own = numbers[-1]
        try:
            models[name] = dataclasses.replace(
                model, source=sources[own], name=name, version=own,
                versions=tuple(ModelVersion(v, sources[v]) for v in numbers[:-1]),
            )  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"[store] {sources[own]}: {exc}") from None
    empty = sorted(name for name, m in models.items() if not m.source and not m.steps)
    if empty:
        raise ValueError(
            f"[[models]] {empty} give no source and [store] root {root!r} holds no such model"
        )
    unknown = sorted(set(config.store.pin) - set(models))
    if unknown:
        raise ValueError(f"[store] pin names unknown model(s) {unknown}")
    return models
