"""``create_runtime`` picks the runtime a ``ServeConfig`` names; ``serve`` runs it under the
``Supervisor`` until a signal stops it. The one module that knows every runtime."""

from __future__ import annotations

from collections.abc import Callable

from .config import ServeConfig
from .protocol.routed import follow_file
from .runtime import Runtime, ServedModels, Supervisor

__all__ = ["create_runtime", "reread_traffic", "serve"]


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
    reread: Callable[[], ServeConfig] | None = None,
) -> int:
    """Serve ``config`` in the foreground until SIGINT/SIGTERM; returns the exit code. What
    ``servekit serve`` runs. SIGHUP reloads the models and, with ``reread`` (the config
    file read again), applies each traffic split the file changed."""
    runtime = create_runtime(config)
    return Supervisor(
        runtime,
        max_restarts=max_restarts,
        on_event=on_event,
        on_reload=(lambda: reread_traffic(runtime, reread())) if reread is not None else None,
    ).run()


def reread_traffic(runtime: Runtime, config: ServeConfig) -> list[str]:
    """The splits ``config`` gives, applied where ``runtime`` routes (``follow_file``)."""
    if not any(m.traffic for m in config.models):
        return []
    models = getattr(runtime, "models", None)
    # In-process runtimes keep the splits in their ServedModels; the triton runtime's front
    # keeps its own.
    traffic = (
        models.traffic if isinstance(models, ServedModels) else getattr(runtime, "traffic", None)
    )
    if traffic is None:  # Ray: each ingress replica keeps its own split
        raise ValueError(
            f"the {config.runtime} runtime does not re-read traffic splits on SIGHUP: "
            "each ingress replica keeps its own; set one with POST /v2/models/<m>/traffic"
        )
    return follow_file(traffic, config)
