"""Where a server listens: client URLs for a host and its ports, and free loopback ports."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Endpoints", "PortRange", "free_port", "parse_port_range", "said_ports"]


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


PortRange = tuple[int, int]
"""Ports ``first`` to ``last``, both included (``servekit compare --ports 19000:19099``)."""


def parse_port_range(spec: str) -> PortRange:
    """``"19000:19099"`` as ``(19000, 19099)``.

    Raises:
        ValueError: not FIRST:LAST, or outside [1, 65535], or LAST before FIRST.
    """
    try:
        first, last = (int(p) for p in spec.split(":"))
    except ValueError:
        raise ValueError(f"a port range is FIRST:LAST, got {spec!r}") from None
    if not 0 < first <= last < 65536:
        raise ValueError(f"a port range is FIRST:LAST within [1, 65535], got {spec!r}")
    return first, last


def said_ports(ports: Iterable[int]) -> str:
    """Ports as a startup line says them: ascending, runs as ranges (``"8000-8002, 9000"``)."""
    runs: list[list[int]] = []
    for port in sorted(set(ports)):
        if runs and port == runs[-1][1] + 1:
            runs[-1][1] = port
        else:
            runs.append([port, port])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def free_port(within: PortRange | None = None) -> int:
    """A loopback TCP port nothing listens on right now (for tests and benchmarks).

    Chosen below Linux's ephemeral range (32768-60999), where no client connection's own
    port can take it before the server listens, or ``within`` a range given, never the
    same twice per process, and never one another process was handed here in the last ten
    minutes (``_claim``): a port is free between the check and the listen, when another
    process may check it too.

    Raises:
        OSError: no port of ``within`` is free.
    """
    import random
    import socket

    first, last = within or (20000, 32767)
    tries = 200 if within is None else last - first + 1
    candidates = (
        (random.randint(first, last) for _ in range(tries))
        if within is None
        else iter(random.sample(range(first, last + 1), tries))
    )
    for port in candidates:
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
    if within is not None:
        raise OSError(f"no free port left in {first}:{last}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
