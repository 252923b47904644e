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
_CLAIM_S = 600.0


def _claim(port: int) -> bool:
    """Claim ``port`` for this process among every process on the machine that hands ports
    here (two test workers, a benchmark beside a test): a file of recent claims, locked
    while read and appended. False when another live process claimed it in the last
    ``_CLAIM_S`` seconds."""
    import fcntl
    import os
    import tempfile
    import time

    path = os.path.join(tempfile.gettempdir(), f"servekit-ports-{os.getuid()}")
    now, pid = time.time(), os.getpid()
    try:
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            kept = []
            for line in f.read().splitlines():
                try:
                    when, other, claimed = float(line.split()[0]), *map(int, line.split()[1:3])
                except (ValueError, IndexError):
                    continue
                if now - when < _CLAIM_S:
                    kept.append(line)
                    if claimed == port and other != pid:
                        return False
            kept.append(f"{now:.0f} {pid} {port}")
            f.seek(0)
            f.truncate()
            f.write("\n".join(kept) + "\n")
    except OSError:
        pass  # a read-only or full /tmp: the bind check alone
    return True


def free_port() -> int:
    """A loopback TCP port nothing listens on right now (for tests and benchmarks).

    Chosen below Linux's ephemeral range (32768-60999), where no client connection's own
    port can take it before the server listens, never the same twice per process, and
    never one another process was handed here in the last ten minutes (``_claim``): a
    port is free between the check and the listen, when another process may check it too."""
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
        if not _claim(port):
            continue
        _HANDED.add(port)
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
