"""The forwarding front of the Triton runtimes (``servekit serve`` on PyTriton, ``servekit
triton``): servekit's KServe handler on the public port, checking every request, then passing
it to tritonserver over a pooled HTTP connection (``http``) or as tensors over gRPC
(``grpc``)."""

from .front import ForwardedModel, Front, TritonModels

__all__ = ["ForwardedModel", "Front", "TritonModels"]
