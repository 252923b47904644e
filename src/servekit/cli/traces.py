"""``servekit traces``: watch spans locally, each trace printed as a tree as it completes."""

from __future__ import annotations

import signal
import threading
from typing import Annotated

import typer

from .common import console, fail

__all__ = ["traces"]


def traces(
    port: Annotated[int, typer.Option(help="Port to receive OTLP/HTTP on.")] = 4318,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    quiet_s: Annotated[
        float, typer.Option(help="A trace is printed once no span of it came this long.")
    ] = 1.5,
) -> None:
    """Receive OTLP/HTTP traces (protobuf or JSON) on PORT and print each trace as an
    indented tree; point [server.tracing] endpoint at http://HOST:PORT/v1/traces.
    Ctrl-C stops (printing what is still held)."""
    try:
        from ..traces import serve_traces
    except ImportError as exc:
        raise fail(f"servekit traces needs the tracing extra: {exc}", 3) from None
    try:
        server = serve_traces(
            host, port, lambda text: console.print(text, highlight=False, markup=False), quiet_s
        )
    except OSError as exc:
        raise fail(f"cannot listen on {host}:{port}: {exc}", 3) from None
    console.print(f"receiving traces on http://{host}:{port}/v1/traces (Ctrl-C stops)")
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.shutdown()
