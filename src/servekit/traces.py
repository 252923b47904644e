"""Traces to look at without a collector: an OTLP/HTTP receiver that prints each trace as an
indented tree once its spans stop arriving (``servekit traces``).

Takes what servekit, tritonserver and PyTriton send: OTLP/HTTP protobuf, and OTLP/JSON
(tritonserver's exporter, ids in hex), gzip or not. Needs ``opentelemetry-proto`` (the
``tracing`` extra).
"""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Span", "TraceBook", "decode_export", "serve_traces", "tree"]


@dataclass(frozen=True)
class Span:
    """One span as received: ids in hex, times in ns since the epoch."""

    trace: str
    id: str
    parent: str
    name: str
    start: int
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False
    service: str = ""


def _otlp_json(value: Any) -> Any:
    """OTLP/JSON as protobuf's JSON mapping reads it: ids are hex there, base64 here."""
    if isinstance(value, dict):
        return {
            k: base64.b64encode(bytes.fromhex(v)).decode()
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
            else _otlp_json(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_otlp_json(v) for v in value]
    return value


def decode_export(body: bytes, content_type: str = "", encoding: str = "") -> list[Span]:
    """The spans of one OTLP/HTTP traces export (protobuf or JSON, gzip or not).

    Raises:
        ValueError: the body is not an export of either kind.
    """
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    if encoding == "gzip":
        body = gzip.decompress(body)
    kind = trace_service_pb2.ExportTraceServiceRequest
    try:
        if "json" in content_type:
            export = json_format.ParseDict(
                _otlp_json(json.loads(body)), kind(), ignore_unknown_fields=True
            )
        else:
            export = kind.FromString(body)
    except (DecodeError, json_format.ParseError, ValueError) as exc:
        raise ValueError(
            f"not an OTLP traces export ({content_type or 'protobuf'}): {exc}"
        ) from None
    spans = []
    for resource in export.resource_spans:
        service = next(
            (a.value.string_value for a in resource.resource.attributes if a.key == "service.name"),
            "",
        )
        for scope in resource.scope_spans:
            for s in scope.spans:
                attributes = {
                    a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value")
                    for a in s.attributes
                }
                spans.append(
                    Span(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                        s.start_time_unix_nano, s.end_time_unix_nano, attributes,
                        s.status.code == 2, service,
                    )
                )  # fmt: skip
    return spans


def tree(spans: list[Span]) -> str:
    """A trace's spans as an indented tree: each under its parent, in start order; spans
    whose parent never arrived at the top."""
    ids = {s.id for s in spans}
    children: dict[str, list[Span]] = {}
    for s in sorted(spans, key=lambda s: s.start):
        children.setdefault(s.parent if s.parent in ids else "", []).append(s)
    first = min(s.start for s in spans)
    last = max(s.end for s in spans)
    lines = [f"trace {spans[0].trace} ({len(spans)} spans, {(last - first) / 1e6:.2f} ms)"]

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            shown = " ".join(f"{k}={v}" for k, v in sorted(s.attributes.items()))
            where = f" [{s.service}]" if s.service else ""
            failed = " ERROR" if s.error else ""
            lines.append(
                f"{'  ' * depth}{s.name}{where} {(s.end - s.start) / 1e6:.2f} ms "
                f"(+{(s.start - first) / 1e6:.2f}){failed}{'  ' + shown if shown else ''}"
            )
            walk(s.id, depth + 1)

    walk("", 1)
    return "\n".join(lines)


class TraceBook:
    """Spans grouped by trace; a trace is complete once ``quiet_s`` pass without a new span
    of it (its parts come from several processes, each exporting on its own schedule)."""

    def __init__(self, quiet_s: float = 1.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s, self._clock = quiet_s, clock
        self._traces: dict[str, tuple[float, list[Span]]] = {}
        self._lock = threading.Lock()

    def add(self, spans: list[Span]) -> None:
        now = self._clock()
        with self._lock:
            for s in spans:
                _, held = self._traces.get(s.trace, (now, []))
                held.append(s)
                self._traces[s.trace] = (now, held)

    def complete(self, flush: bool = False) -> list[list[Span]]:
        """The traces quiet for ``quiet_s`` (every one with ``flush``), taken out."""
        now = self._clock()
        with self._lock:
            done = [
                t for t, (seen, _) in self._traces.items() if flush or now - seen >= self.quiet_s
            ]
            return [self._traces.pop(t)[1] for t in done]


def serve_traces(
    host: str, port: int, show: Callable[[str], None], quiet_s: float = 1.5
) -> http.server.ThreadingHTTPServer:
    """An OTLP/HTTP receiver on ``host:port`` (``POST /v1/traces``) that hands ``show``
    each complete trace as a tree; returned serving on a thread (``shutdown()`` stops it)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

    book = TraceBook(quiet_s)
    ok = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                book.add(
                    decode_export(
                        body,
                        self.headers.get("Content-Type", ""),
                        self.headers.get("Content-Encoding", ""),
                    )
                )
            except ValueError as exc:
                self.send_error(400, str(exc))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(ok)))
            self.end_headers()
            self.wfile.write(ok)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    stop = threading.Event()

    def printer() -> None:
        while not stop.wait(0.25):
            for spans in book.complete():
                show(tree(spans))
        for spans in book.complete(flush=True):
            show(tree(spans))

    threads = [
        threading.Thread(target=server.serve_forever, name="servekit-traces", daemon=True),
        threading.Thread(target=printer, name="servekit-traces-print", daemon=True),
    ]
    for t in threads:
        t.start()
    shutdown = server.shutdown

    def stop_all() -> None:
        shutdown()
        stop.set()
        threads[1].join(5)

    server.shutdown = stop_all  # type: ignore[method-assign]
    return server
