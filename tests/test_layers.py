"""Imports go down: every module of servekit imports only from its own package and from
packages in lower layers (lazy imports inside functions count too). docs/development.md
draws the same layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "servekit"

# Lowest first. A package may import its own modules and any package of a lower layer;
# packages in one layer are independent of each other.
LAYERS: list[set[str]] = [
    {"_version", "cuda", "errors", "spans", "tables", "window"},
    {"endpoints", "compression", "device", "samples", "storage", "tracing", "traces"},
    {"spec"},
    {"runners"},  # the Runner contract (runners.base) and the engines, imported lazily
    {"autoscale", "batching", "cache", "custom", "recovery", "rollout", "stages", "zoo"},
    {"config", "metrics", "pipeline"},
    {"client", "optimize", "accuracy", "protocol"},
    {"http", "grpc"},  # servers: each builds on protocol, neither on the other
    {"runtime"},  # the Runtime contract, load_models, the Supervisor
    {"front", "store"},  # the forwarding front of the Triton runtimes; the model store
    {"native", "triton"},
    {"pytriton", "ray"},  # pytriton starts tritonserver with triton's environment
    {"serving"},  # create_runtime: the one module that knows every runtime
    {"bench"},
    {"tune"},
    {"cli"},
    {"__init__", "__main__"},
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def package_of(module: str) -> str:
    """``servekit.http.app`` -> ``http``; ``servekit`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported servekit module) for every import in ``path``, at any depth."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("servekit")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("servekit"):
                continue
            if target == "servekit":  # `from .. import zoo` imports servekit.zoo
                found += [(node.lineno, f"servekit.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = package_of(module_name(path)) if path.name != "__main__.py" else "__main__"
        if path.parent == PACKAGE and path.stem in ("__init__", "__main__"):
            source = path.stem
        for line, target in imports(path):
            dest = package_of(target)
            if dest == source:
                continue
            if LAYER[dest] >= LAYER[source]:
                where = path.relative_to(SRC)
                bad.append(
                    f"{where}:{line} ({source}, layer {LAYER[source]}) imports {target} "
                    f"(layer {LAYER[dest]})"
                )
    return bad


def test_every_package_has_a_layer():
    packages = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    }
    assert packages == set(LAYER), "add the new package to LAYERS (and docs/development.md)"


def test_imports_go_down():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walker is not vacuous: a lazy import of a runtime from the core is caught."""
    fake = tmp_path / "servekit"
    (fake / "batching").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "batching" / "__init__.py").write_text("def f():\n    from ..native import x\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    bad = upward_imports()
    assert len(bad) == 1 and "imports servekit.native" in bad[0]


@pytest.mark.parametrize("name", ["protocol", "batching", "runners", "spec", "config"])
def test_core_packages_import_no_runtime(name):
    runtimes = {"native", "triton", "pytriton", "ray", "front", "serving", "http", "grpc"}
    root = PACKAGE / name
    paths = sorted(root.rglob("*.py")) if root.is_dir() else [PACKAGE / f"{name}.py"]
    reached = {package_of(t) for p in paths for _, t in imports(p)}
    assert not reached & runtimes


MAX_LINES = 500


def long_files(root: Path) -> list[str]:
    """Modules over ``MAX_LINES`` lines under ``root``: one a reader cannot hold in one
    sitting; split it by job."""
    return [
        f"{p.relative_to(root)}: {n} lines"
        for p in sorted(root.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    ]


def test_no_module_is_over_500_lines():
    assert long_files(PACKAGE) == []


def test_the_length_check_sees_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert long_files(tmp_path) == [f"long.py: {MAX_LINES + 1} lines"]
