"""OpenTelemetry traces of requests (``servekit.tracing``, ``[server.tracing]``), received
by a real OTLP/HTTP endpoint this test runs, which decodes each export with the
``opentelemetry-proto`` messages: a client's ``traceparent`` continues into the server's
``infer`` span, with the request's queue wait and its batch as children; the settings of
Triton's trace extension change sampling at runtime over HTTP and gRPC, behind the
control token."""

from __future__ import annotations

import base64
import gzip
import http.server
import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import each_client, free_port, needs_runtime, started, wait_until
from servekit import ModelConfig, ServeConfig, ServerConfig
from servekit.config import TracingConfig

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the tracing extra")
pytest.importorskip("tritonclient", reason="needs the triton extra")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

TOKEN = "tracing-control"


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


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture(scope="module", params=["native", "triton", "pytriton", "ray"])
def served(request, receiver, add_sub_path):
    """add_sub with every request traced, on native, triton and pytriton (HTTP and gRPC;
    tritonserver in its OpenTelemetry mode behind servekit's front) and ray (HTTP)."""
    needs_runtime(request.param)
    server = ServerConfig(
        control_token=TOKEN, tracing=TracingConfig(endpoint=receiver.url, rate=1.0)
    )
    config = ServeConfig(
        (ModelConfig(str(add_sub_path), "add_sub"),), server, runtime=request.param
    ).on_loopback()
    with started(config):
        yield config.server, request.param


def traceparent() -> tuple[str, str, str]:
    """A caller's trace: (traceparent, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def pair(module):
    tensors = [module.InferInput(n, [1, 16], "FP32") for n in ("INPUT0", "INPUT1")]
    for t in tensors:
        t.set_data_from_numpy(np.ones((1, 16), np.float32))
    return tensors


def call(server, runtime: str, k: int, header: str) -> None:
    """One request from client ``k`` (gRPC for odd k where the runtime has it)."""
    grpc = k % 2 and runtime != "ray"
    module = grpcclient if grpc else httpclient
    c = module.InferenceServerClient(f"127.0.0.1:{server.grpc_port if grpc else server.http_port}")
    try:
        result = c.infer("add_sub", pair(module), headers={"traceparent": header})
        assert np.all(result.as_numpy("OUTPUT0") == 2.0)
    finally:
        c.close()


def setting(server, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server.http_url}/v2/trace/setting",
        None if body is None else json.dumps(body).encode(),
        {"servekit-control-token": token} if token else {},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_callers_trace_continues_into_the_request_its_queue_wait_and_its_batch(served, receiver):
    server, runtime = served
    sent: dict[int, tuple[str, str, str]] = {}

    def client(k: int) -> None:
        for i in range(3):
            header, trace_id, span_id = traceparent()
            sent[10 * k + i] = (header, trace_id, span_id)
            call(server, runtime, k, header)

    each_client(client)
    # servekit's queue wait and batch, or, behind the front, tritonserver's own spans
    # (its request, the model's execution, the compute) under the front's.
    # PyTriton's model side adds its own spans too (its stub and its proxy), in the same trace.
    behind = runtime in ("triton", "pytriton")
    below = ["InferRequest", "add_sub", "compute"] if behind else ["queue", "batch"]
    extra = (
        {"python_backend_execute", "proxy_inference_callable"} if runtime == "pytriton" else set()
    )

    def names(trace_id: str) -> set[str]:
        return {s["name"] for s in receiver.of(trace_id)}

    # tritonserver 2.51 now and then starts a gRPC request's trace as a root of its own
    # though the relayed call carries the traceparent (seen 2 of 12 calls at most here):
    # over gRPC a trace there may lack tritonserver's spans, never hold them elsewhere.
    joined, want = 0, {"infer", *below, *extra}

    def relayed(key: int) -> bool:  # a gRPC call through the Triton runtimes' front
        return behind and key // 10 % 2 == 1

    wait_until(
        lambda: all(names(t) >= ({"infer"} if relayed(k) else want) for k, (_, t, _) in sent.items()),
        "every trace's spans", 20,
    )  # fmt: skip
    if behind:
        time.sleep(2)  # tritonserver's spans of the relayed calls, sent in the same batches
    for key, (_, trace_id, caller) in sent.items():
        grpc = relayed(key)
        by_name = {s["name"]: s for s in receiver.of(trace_id)}
        if behind and grpc and set(by_name) == {"infer"}:
            continue
        assert set(by_name) == want, (trace_id, set(by_name), len(receiver.spans))
        joined += 1
        infer = by_name["infer"]
        assert infer["parent"] == caller  # the caller's span is the server span's parent
        assert infer["attributes"]["model"] == "add_sub"
        if behind:
            request, model, compute = (by_name[n] for n in below)
            assert request["parent"] == infer["id"]
            assert model["parent"] == request["id"] and compute["parent"] == model["id"]
            assert model["attributes"]["triton.model_name"] == "add_sub"
            continue
        queue, batch = by_name["queue"], by_name["batch"]
        assert queue["parent"] == batch["parent"] == infer["id"]
        assert infer["start"] <= queue["start"] <= queue["end"] <= batch["end"] <= infer["end"]
        assert batch["attributes"]["batch_rows"] >= 1
    assert joined >= len(sent) * 3 // 4, f"{joined} of {len(sent)} traces whole"
    protocols = {
        s["attributes"]["protocol"]
        for _, trace_id, _ in sent.values()
        for s in receiver.of(trace_id)
        if s["name"] == "infer"
    }
    assert protocols == ({"http"} if runtime == "ray" else {"http", "grpc"})


def test_sampling_is_set_to_none_and_back_at_runtime_behind_the_control_token(served, receiver):
    server, runtime = served
    assert setting(server)[1]["trace_level"] == ["TIMESTAMPS"]
    status, answer = setting(server, {"trace_level": ["OFF"]}, token=None)
    assert status == 401 and "servekit-control-token" in answer["error"]
    status, answer = setting(server, {"trace_rate": "many"})
    assert status == 400 and "trace_rate" in answer["error"]
    assert setting(server, {"trace_level": ["OFF"]}) == (200, setting(server)[1])
    header, off, _ = traceparent()
    call(server, runtime, 0, header)
    if runtime == "ray":
        assert setting(server, {"trace_level": ["TIMESTAMPS"], "trace_rate": "2"})[0] == 200
    else:  # back on over gRPC, with Triton's TraceSetting
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        try:
            with pytest.raises(Exception, match="servekit-control-token"):
                c.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
            got = c.update_trace_settings(
                settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "2"},
                headers={"servekit-control-token": TOKEN},
                as_json=True,
            )
            assert got["settings"]["trace_rate"]["value"] == ["2"]
        finally:
            c.close()
    traced = []
    for _ in range(6):  # one in two
        header, trace_id, _ = traceparent()
        call(server, runtime, 0, header)
        traced.append(trace_id)

    def ours(trace_id: str) -> bool:  # the front's span (tritonserver samples on its own)
        return any(s["name"] == "infer" for s in receiver.of(trace_id))

    wait_until(lambda: sum(ours(t) for t in traced) == 3, "one in two traced", 20)
    assert receiver.of(off) == []  # tritonserver's level followed the front's to OFF
    assert setting(server, {"trace_rate": "1"})[1]["trace_rate"] == "1"
