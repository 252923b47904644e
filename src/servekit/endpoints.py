"""Where a server listens: client URLs for a host and its ports, and free loopback ports."""

from __future__ import annotations

from typing import Any

__all__ = ["Endpoints", "free_port"]


class Endpoints:
    """Client URLs for a Triton listening on ``host`` and its three ports."""

    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{self.client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def listening(self, grpc: bool = True, metrics_port: bool = True) -> str:
        """What is bound, as a startup line says it: the address and every port."""
        ports = [f"HTTP {self.http_port}"]
        if grpc:
            ports.append(f"gRPC {self.grpc_port}")
        ports.append(
            f"metrics {self.metrics_port}" if metrics_port else "metrics at HTTP's /metrics"
        )
        host = self.host or "0.0.0.0"
        where = "every interface" if host in ("0.0.0.0", "::") else host
        return f"{host} ({where}): {', '.join(ports)}"

    @classmethod
    def on_loopback(cls, **fields: Any) -> Any:
        """This config on 127.0.0.1 with three free ports (tests, benchmarks, ``compare``)."""
        ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
        return cls(**{"host": "127.0.0.1", **ports, **fields})


_HANDED: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (for tests and benchmarks).

    Chosen below Linux's ephemeral range (32768-60999), where no client connection's own
    port can take it before the server listens, and never the same twice per process."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32767)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
