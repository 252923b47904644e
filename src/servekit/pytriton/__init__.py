"""The ``pytriton`` runtime: servekit runners served by Triton through PyTriton."""

from .server import TritonServer

__all__ = ["TritonServer"]
