"""The KServe v2 HTTP front: protocol encoding (``kserve``) and an ASGI app (``app``)."""

from .app import KServeApp, serve_http
from .kserve import DecodedRequest, decode_request, encode_response, metadata

__all__ = [
    "DecodedRequest",
    "KServeApp",
    "decode_request",
    "encode_response",
    "metadata",
    "serve_http",
]
