"""The environment Triton's Python backend stub needs, set by servekit's launchers themselves.

The stub (one process per model instance) links the shared ``libpython3.X.so`` and
imports packages from the ``python`` first on ``PATH``. In a virtualenv neither is
where the stub looks, so every launcher puts the interpreter's ``LIBDIR`` and the
PyTriton wheel's bundled libraries first on ``LD_LIBRARY_PATH`` and the
virtualenv's ``bin`` first on ``PATH``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import TritonSetupError

__all__ = [
    "TritonEnvironment",
    "TritonSetupError",
    "apply_triton_environment",
    "gpu_present",
    "triton_environment",
]


def gpu_present() -> bool:
    """Whether an NVIDIA driver exposes a GPU here (Triton's GPU metrics are off otherwise)."""
    return Path("/dev/nvidiactl").exists() or Path("/dev/nvidia0").exists()


@dataclass(frozen=True)
class TritonEnvironment:
    env: dict[str, str]
    """The full environment for tritonserver and its stubs."""
    tritonserver: Path
    """PyTriton's bundled ``tritonserver`` directory (bin/, backends/, python_backend_stubs/)."""
    libpython: Path
    stub: Path
    """The Python backend stub for the running Python version."""


def _prepend(value: str, existing: str | None) -> str:
    parts = [value] + [p for p in (existing or "").split(os.pathsep) if p and p != value]
    return os.pathsep.join(parts)


def triton_environment(base: Mapping[str, str] | None = None) -> TritonEnvironment:
    """Check the installation and return the environment the stub needs.

    Raises:
        TritonSetupError: PyTriton missing, no shared libpython, or no stub for this Python.
    """
    try:
        import pytriton
    except ImportError:
        raise TritonSetupError(
            "PyTriton is not installed: pip install 'servekit[triton]' (needs numpy < 2)"
        ) from None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    libdir = Path(sysconfig.get_config_var("LIBDIR") or "")
    libpython = libdir / f"libpython{version}.so"
    candidates = sorted(libdir.glob(f"libpython{version}*.so*")) if libdir.is_dir() else []
    if not libpython.exists() and not candidates:
        raise TritonSetupError(
            f"Triton's Python backend stub links libpython{version}.so, but {libdir} has none: "
            "use a Python built with shared libraries (pyenv: "
            "PYTHON_CONFIGURE_OPTS=--enable-shared pyenv install, or Debian's python3-dev)"
        )
    package = Path(pytriton.__file__).parent
    tritonserver = package / "tritonserver"
    stub = tritonserver / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        have = sorted(p.name for p in (tritonserver / "python_backend_stubs").glob("*"))
        raise TritonSetupError(
            f"PyTriton ships no Python backend stub for Python {version} (it has {have}); "
            "use one of those Python versions"
        )
    env = dict(os.environ if base is None else base)
    wheel_libs = package.parent / "nvidia_pytriton.libs"
    ld = _prepend(str(wheel_libs), env.get("LD_LIBRARY_PATH"))
    env["LD_LIBRARY_PATH"] = _prepend(str(libdir), ld)
    env["PATH"] = _prepend(str(Path(sys.executable).parent), env.get("PATH"))
    return TritonEnvironment(env, tritonserver, candidates[0] if candidates else libpython, stub)


def apply_triton_environment() -> TritonEnvironment:
    """Set the stub's environment on this process, so the tritonserver it starts inherits it."""
    found = triton_environment()
    for key in ("LD_LIBRARY_PATH", "PATH"):
        os.environ[key] = found.env[key]
    return found
