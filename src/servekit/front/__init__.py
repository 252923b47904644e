"""The forwarding front of the Triton runtimes (``servekit serve`` on PyTriton, ``servekit
triton``): servekit's KServe handler on the public HTTP port, checking every request, then
passing it to tritonserver over a pooled HTTP connection (``http``), and servekit's gRPC
server on the public gRPC port, passing calls on as their bytes (``relay``, ``grpc``)."""

from .forwarded import ForwardedModel
from .models import TritonModels
from .server import Front

__all__ = ["ForwardedModel", "Front", "TritonModels"]
