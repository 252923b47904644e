"""The ``native`` runtime: servekit's own KServe v2 server in one process, no Triton, no Ray."""

from .server import NativeServer

__all__ = ["NativeServer"]
