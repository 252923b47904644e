"""``[ray] direct``: each ingress replica serves HTTP itself, without Ray's HTTP proxy.

Ray's proxy hands every request to the ingress through a Ray actor call, which on this
project's 2-core VM cost 6.9 ms of CPU per request, the proxy's side and the replica's
(BENCHMARKS.md): nearly four times a simulated T4's time per row at batch 32, so the
device idled more than half the time whatever the batching behind it. With ``direct``,
each ingress replica listens on ``server.http_port`` with servekit's own HTTP server (the
native runtime's; ``SO_REUSEPORT``, so every ingress replica on a host shares the port
and the kernel spreads connections over them). The replica batches requests as before
and one handle call carries each batch to the model deployments, which Ray places,
scales and restarts as before. Ray's proxy is not started (``servekit.ray.runtime``), so
each replica's batchers run on this server's loop alone.
"""

from __future__ import annotations

from typing import Any

from ..config import ServeConfig
from ..errors import ModelNotReady
from ..http import KServeApp
from ..http.h1 import H1Server
from ..http.messages import Answer, HttpRequest

__all__ = ["listen"]


def listen(app: KServeApp, config: ServeConfig, gate: Any) -> H1Server:
    """Serve ``app`` on the config's HTTP port from this replica, through its drain
    ``gate`` (``servekit.ray.drain``) as Ray's proxy's requests go."""
    s = config.server
    refusal = app.error(ModelNotReady("servekit is stopping: this server takes no new requests"))

    async def handle(request: HttpRequest) -> Answer:
        if not gate.enter():
            return refusal
        try:
            return await app.handle(request)
        finally:
            gate.leave()

    return H1Server(
        handle, s.host, s.http_port, reuse_port=True, max_body_bytes=s.max_body_bytes,
        name="servekit-ray-direct", **s.http_limits(),
    ).start()  # fmt: skip
