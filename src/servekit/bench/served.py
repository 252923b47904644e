"""A benchmark's server and clients: ``servekit serve --config`` in a process of its own
(started, ready, always stopped), closed-loop clients on threads, and the row a run
reports (server CPU of the whole process tree per request, throughput, latency)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from .stats import percentile

__all__ = ["clients", "cost_row", "serve_process"]


@contextlib.contextmanager
def serve_process(
    config: Path,
    url: str,
    model: str,
    timeout_s: float = 120,
    command: Sequence[str] = ("serve",),
) -> Iterator[subprocess.Popen[bytes]]:
    """``servekit serve --config config`` (or another ``command`` with the config, such as
    ``("triton", "--model-repository", ...)``), yielded once ``model`` is ready at ``url``."""
    from ..client import Client

    head, *rest = command
    argv = [sys.executable, "-m", "servekit", head, "--config", str(config), *rest]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        with Client(url) as ready:
            ready.wait_ready(model, timeout_s=timeout_s)
        yield server
    finally:
        server.terminate()
        server.wait(60)


def clients(count: int, work: Callable[[int], list[float]]) -> tuple[list[float], float]:
    """``work(k)`` for each of ``count`` clients at once, each on its own thread, returning
    its requests' latencies (s): all of them, sorted, and the wall time the run took."""
    latencies: list[float] = []
    lock = threading.Lock()

    def run(k: int) -> None:
        mine = work(k)
        with lock:
            latencies.extend(mine)

    began = time.monotonic()
    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    return latencies, time.monotonic() - began


def cost_row(latencies: list[float], wall_s: float, cpu_s: float) -> dict[str, float]:
    """Requests, server CPU per request (us), requests/s, p50 and p99 (ms) of one run."""
    n = len(latencies)
    return {
        "requests": n,
        "server_cpu_us_per_request": round(cpu_s / n * 1e6, 1),
        "requests_per_s": round(n / wall_s, 1),
        "p50_ms": round(percentile(latencies, 50) * 1e3, 2),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 2),
    }
