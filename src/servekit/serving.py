"""``create_runtime`` picks the runtime a ``ServeConfig`` names; ``serve`` runs it under the
``Supervisor`` until a signal stops it. The one module that knows every runtime."""

from __future__ import annotations

from collections.abc import Callable

from .config import ServeConfig
from .runtime import Runtime, Supervisor

__all__ = ["create_runtime", "serve"]


def create_runtime(config: ServeConfig) -> Runtime:
    """The runtime ``config.runtime`` names, built from ``config`` (nothing loads yet:
    ``start`` loads, warms up and listens).

    Raises:
        ValueError: a knob the runtime cannot honour, named with the runtime.
    """
    if config.runtime == "native":
        from .native import NativeServer

        return NativeServer(config)
    if config.runtime == "pytriton":
        from .pytriton import TritonServer

        return TritonServer.from_config(config)
    if config.runtime == "triton":
        from .triton.runtime import TritonRuntime

        return TritonRuntime(config)
    from .ray.runtime import RayRuntime

    return RayRuntime(config)


def serve(
    config: ServeConfig,
    *,
    max_restarts: int = 5,
    on_event: Callable[[str], None] | None = None,
) -> int:
    """Serve ``config`` in the foreground until SIGINT/SIGTERM (SIGHUP reloads the models);
    returns the exit code. What ``servekit serve`` runs."""
    return Supervisor(create_runtime(config), max_restarts=max_restarts, on_event=on_event).run()
