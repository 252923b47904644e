"""An OTLP/HTTP traces endpoint for tests: a real receiver on loopback that decodes each
export with the ``opentelemetry-proto`` messages (protobuf, or OTLP/JSON as tritonserver
sends it)."""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import threading

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from conftest import free_port


def otlp_json(value):
    """OTLP/JSON as protobuf's JSON mapping reads it: ids are hex there, base64 here."""
    if isinstance(value, dict):
        return {
            k: base64.b64encode(bytes.fromhex(v)).decode()
            if k in ("traceId", "spanId", "parentSpanId") and isinstance(v, str)
            else otlp_json(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [otlp_json(v) for v in value]
    return value


class Receiver:
    """An OTLP/HTTP traces endpoint on loopback: every span it is sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        spans, lock = self.spans, self.lock

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                kind = trace_service_pb2.ExportTraceServiceRequest
                if "json" in self.headers.get("Content-Type", ""):  # tritonserver's exporter
                    export = json_format.ParseDict(
                        otlp_json(json.loads(body)), kind(), ignore_unknown_fields=True
                    )
                else:
                    export = kind.FromString(body)
                got = [
                    {
                        "trace": s.trace_id.hex(),
                        "id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(),
                        "name": s.name,
                        "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano,
                        "attributes": {
                            a.key: getattr(a.value, a.value.WhichOneof("value"))
                            for a in s.attributes
                        },
                        "error": s.status.code == 2,
                    }
                    for r in export.resource_spans
                    for scope in r.scope_spans
                    for s in scope.spans
                ]
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
