"""A small kustomize renderer for the manifests in ``k8s/``, a test helper: CI renders every overlay with it.

It implements the subset those manifests use, with kustomize's meaning: ``resources``
(files, or folders holding a ``kustomization.yaml``), ``namespace``, ``images``
(``newName``/``newTag``), ``patches`` as JSON 6902 operations (``add``, ``replace``,
``remove``) on a ``target`` kind and name, and ``configMapGenerator`` with ``literals``
under ``generatorOptions.disableNameSuffixHash: true``. Anything else is an error, so a
manifest that real kustomize would read differently cannot slip through.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

__all__ = ["KustomizeError", "render", "render_yaml"]

_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "images",
    "patches",
    "configMapGenerator",
    "generatorOptions",
}
_NAMESPACED_EXCEPT = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


class KustomizeError(ValueError):
    """A kustomization this renderer does not understand, or one that is wrong."""


def render(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The resources a kustomization folder renders to, in order."""
    import yaml

    root = Path(path)
    kfile = root / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - _KEYS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported fields {sorted(unknown)}")
    out: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        target = (root / entry).resolve()
        if target.is_dir():
            out.extend(render(target))
        elif target.is_file():
            out.extend(d for d in yaml.safe_load_all(target.read_text()) if d)
        else:
            raise KustomizeError(f"{kfile}: resource {entry!r} does not exist")
    out.extend(_config_maps(kfile, spec))
    for patch in spec.get("patches", []):
        _patch(kfile, out, patch)
    for image in spec.get("images", []):
        _image(out, image)
    if "namespace" in spec:
        for doc in out:
            if doc.get("kind") not in _NAMESPACED_EXCEPT:
                doc.setdefault("metadata", {})["namespace"] = spec["namespace"]
    seen: set[tuple[str, str]] = set()
    for doc in out:
        key = (doc.get("kind", ""), doc.get("metadata", {}).get("name", ""))
        if key in seen:
            raise KustomizeError(f"{kfile}: {key[0]} {key[1]!r} is defined twice")
        seen.add(key)
    return out


def render_yaml(path: str | os.PathLike[str]) -> str:
    """``render`` as one multi-document YAML stream (what ``kustomize build`` prints)."""
    import yaml

    return yaml.safe_dump_all(render(path), sort_keys=False)


def _config_maps(kfile: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    generators = spec.get("configMapGenerator", [])
    if generators and not spec.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise KustomizeError(f"{kfile}: configMapGenerator needs disableNameSuffixHash: true")
    maps = []
    for gen in generators:
        if set(gen) - {"name", "literals"}:
            raise KustomizeError(f"{kfile}: configMapGenerator supports name and literals only")
        data = {}
        for literal in gen.get("literals", []):
            key, sep, value = literal.partition("=")
            if not sep:
                raise KustomizeError(f"{kfile}: literal {literal!r} is not KEY=VALUE")
            data[key] = value
        maps.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    return maps


def _patch(kfile: Path, docs: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    import yaml

    target = patch.get("target", {})
    if set(target) - {"kind", "name"} or "kind" not in target:
        raise KustomizeError(f"{kfile}: a patch target needs kind (and name); got {target}")
    if "path" in patch:
        ops = yaml.safe_load((kfile.parent / patch["path"]).read_text())
    else:
        ops = yaml.safe_load(patch.get("patch", ""))
    if not isinstance(ops, list):
        raise KustomizeError(
            f"{kfile}: only JSON 6902 patches (a list of operations) are supported"
        )
    matched = [
        d
        for d in docs
        if d.get("kind") == target["kind"]
        and ("name" not in target or d.get("metadata", {}).get("name") == target["name"])
    ]
    if not matched:
        raise KustomizeError(f"{kfile}: patch target {target} matches no resource")
    for doc in matched:
        for op in ops:
            _apply(kfile, doc, op)


def _apply(kfile: Path, doc: dict[str, Any], op: dict[str, Any]) -> None:
    kind, pointer = op.get("op"), op.get("path", "")
    if kind not in ("add", "replace", "remove") or not pointer.startswith("/"):
        raise KustomizeError(f"{kfile}: unsupported patch operation {op}")
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer[1:].split("/")]
    parent: Any = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent.get(part)
        if parent is None:
            raise KustomizeError(f"{kfile}: patch path {pointer} does not exist")
    last = parts[-1]
    value = copy.deepcopy(op.get("value"))
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, value)
        elif index >= len(parent):
            raise KustomizeError(f"{kfile}: patch path {pointer} does not exist")
        elif kind == "replace":
            parent[index] = value
        else:
            del parent[index]
        return
    if kind != "add" and last not in parent:
        raise KustomizeError(f"{kfile}: patch path {pointer} does not exist")
    if kind == "remove":
        del parent[last]
    else:
        parent[last] = value


def _image(docs: list[dict[str, Any]], image: dict[str, Any]) -> None:
    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    for c in value:
                        name, _, tag = str(c.get("image", "")).partition(":")
                        if name == image["name"]:
                            new = image.get("newName", name)
                            c["image"] = f"{new}:{image.get('newTag', tag or 'latest')}"
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(docs)
