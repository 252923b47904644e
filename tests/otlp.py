"""An OTLP/HTTP traces endpoint for tests: a real receiver on loopback that decodes each
export as ``servekit traces`` does (``servekit.traces.decode_export``: the
``opentelemetry-proto`` messages, protobuf or OTLP/JSON as tritonserver sends it)."""

from __future__ import annotations

import dataclasses
import http.server
import threading

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from conftest import free_port
from servekit.traces import decode_export


class Receiver:
    """An OTLP/HTTP traces endpoint on loopback: every span it is sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        spans, lock = self.spans, self.lock

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                decoded = decode_export(
                    body,
                    self.headers.get("Content-Type", ""),
                    self.headers.get("Content-Encoding", ""),
                )
                got = [dataclasses.asdict(s) for s in decoded]
                with lock:
                    spans.extend(got)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
