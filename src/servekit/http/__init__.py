"""servekit's KServe v2 HTTP server: the request handler (``app``) and its HTTP/1.1 server
(``h1``); the protocol itself lives in ``servekit.protocol``."""

from .app import KServeApp
from .asgi import serve_http

__all__ = ["KServeApp", "serve_http"]
